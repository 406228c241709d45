"""Helpers the quantized linear methods share: creating and replacing parameters, loading
scalar scales, unpacking int32-packed integers, and finding the layer's kernels."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

# pack_int32 / unpack_int32 live with the kernels' spec (fused_moe_wna16 unpacks with it);
# the quantization methods import them from here.
from engine.kernels.quantized import FP8_DTYPE, FP8_MAX, pack_int32, unpack_int32
from engine.kernels.reference import REFERENCE_KERNELS
from engine.layers.linear import ShardLayout, set_shard_layout
from engine.layers.weight_utils import ModelLoadError, materialize, new_parameter, set_weight_loader

if TYPE_CHECKING:
    from engine.layers.linear import LinearBase

# AWQ's GEMM format packs 8 columns into an int32 in this order: nibble i holds column
# AWQ_PACK_ORDER[i] of the group of 8 (AutoAWQ's ``order_map``); unpacking reads column j
# from nibble AWQ_REVERSE_ORDER[j].
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def kernel(layer: LinearBase, name: str) -> Any:
    """The layer's bound kernel ``name`` (the torch reference when the layer was built without
    a kernel registry, as unit tests do)."""
    kernels = getattr(layer, "kernels", None)
    return getattr(kernels, name) if kernels is not None else REFERENCE_KERNELS[name]


def add_param(
    layer: LinearBase,
    name: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    layout: ShardLayout,
    loader: Any = None,
) -> nn.Parameter:
    """Register an uninitialised parameter ``name`` on ``layer`` with ``layout`` (and a loader
    of its own, else the layer's sharding loader)."""
    param = set_shard_layout(new_parameter(tuple(shape), dtype), layout)
    if loader is not None:
        set_weight_loader(param, loader)
    layer.register_parameter(name, param)
    return param


def per_slice_scale(layer: LinearBase, name: str, dtype: torch.dtype = torch.float32) -> None:
    """A per-tensor scale of each fused output slice (``[num_slices]``), loaded from scalar
    (``[]``) or one-element (``[1]``) checkpoint tensors."""
    slices = len(layer.output_slices)
    layout = ShardLayout(output_dim=None, input_dim=None, per_slice=slices > 1)
    add_param(layer, name, (slices,), dtype, layout, loader=_scalar_loader(layer))


def _scalar_loader(layer: LinearBase) -> Any:
    def load(param: nn.Parameter, loaded: Any, shard_id: object | None = None) -> None:
        if math.prod(tuple(loaded.shape)) != 1:
            raise ModelLoadError(
                f"{layer.prefix}: expected a per-tensor scale (one element), got shape "
                f"{tuple(loaded.shape)}"
            )
        value = materialize(loaded)
        if len(layer.output_slices) > 1:
            layer.weight_loader(param, value.reshape(1), shard_id)
        else:
            param.data.copy_(value.reshape(1))

    return load


def replace_param(layer: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Drop parameter ``name`` and, when ``value`` is given, register it in its place (frozen)."""
    if name in layer._parameters:
        del layer._parameters[name]
    if value is not None:
        layer.register_parameter(name, nn.Parameter(value, requires_grad=False))


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM ``[rows, cols / 8]`` int32 -> uint8 ``[rows, cols]`` 4-bit values in column
    order."""
    nibbles = unpack_int32(packed, 4, dim=1)  # [rows, cols]: nibble order within each word
    rows, cols = nibbles.shape
    order = torch.tensor(AWQ_REVERSE_ORDER, device=packed.device)
    return nibbles.view(rows, cols // 8, 8).index_select(2, order).reshape(rows, cols)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """uint8 ``[rows, cols]`` 4-bit values -> AWQ GEMM int32 ``[rows, cols / 8]``."""
    rows, cols = values.shape
    order = torch.tensor(AWQ_PACK_ORDER, device=values.device)
    nibbles = values.view(rows, cols // 8, 8).index_select(2, order).reshape(rows, cols)
    return pack_int32(nibbles, 4, dim=1)


def fill_uniform_int(param: torch.Tensor, low: int, high: int, generator: torch.Generator) -> None:
    """Fill an integer parameter with values uniform in ``[low, high)`` (dummy weights)."""
    values = torch.randint(
        low, high, param.shape, generator=generator, device=param.device, dtype=torch.int64
    )
    param.data.copy_(values.to(param.dtype))


def fill_random_bits(param: torch.Tensor, generator: torch.Generator) -> None:
    """Fill an int32 parameter with random bit patterns (every packed value uniform)."""
    values = torch.randint(
        -(1 << 31),
        1 << 31,
        param.shape,
        generator=generator,
        device=param.device,
        dtype=torch.int64,
    )
    param.data.copy_(values.to(torch.int32))


def random_fp8(shape: Sequence[int], std: float, generator: torch.Generator, device: Any):
    """Random e4m3 values of standard deviation ``std`` (dummy FP8 weights)."""
    values = torch.randn(tuple(shape), generator=generator, device=device) * std
    return values.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[N, K]`` -> (e4m3 ``[N, K]``, float32 scale ``[N]``): each row scaled so its
    largest magnitude maps to 448."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_fp8_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` -> (e4m3, float32 scale ``[1]``) with one scale for the whole tensor."""
    w = weight.float()
    scale = (w.abs().amax() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny).reshape(1)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
