"""LoRA on the linear-layer family: a ``LinearMethod`` that adds ``x @ A @ B`` to the output.

``LoRALinearMethod`` wraps a layer's own method (unquantized, oneDNN-packed, FP8, GPTQ, ...):
``apply`` lets the base method compute ``x W^T + b`` for this rank's shard, then adds every
token's adapter to each of the layer's output slices with one ``add_lora_linear`` kernel call.
Because the wrapper sits where the method does, the layer's parallel style is untouched:

* column-parallel (``ColumnParallelLinear``, fused ``QKVParallelLinear`` /
  ``MergedColumnParallelLinear``): the rank computes its output features, so it holds each
  slice's B shard (the rows of its features; replicated KV heads take the KV rank's rows) and
  A whole; no collective is needed, and ``gather_output`` gathers base and LoRA together;
* row-parallel (``RowParallelLinear``): the rank holds A's columns of its input features and B
  whole, and adds ``(x_r A_r^T) B^T`` to its *partial* product before the layer's all-reduce.
  The sum over ranks is ``sum_r x_r W_r^T + (sum_r x_r A_r^T) B^T = x W^T + (x A^T) B^T``: B is
  linear, so applying it per rank and letting the base all-reduce add the results is exact.
  That is the one collective the layer already makes. The alternative, an all-reduce of the
  shrunk ``[T, rank]`` products before ``@ B``, is a second collective per layer (tiny, but a
  full latency each) for the same result, so it is not used.

Each wrapped layer holds, for the ``max_loras`` device slots, ``lora_a [slots, S*R, in_r]``
(the S slices' A matrices stacked, zero-padded to ``R = max_lora_rank``) and
``lora_b [slots, out_r, R]`` (the slices' B shards, the adapter's scaling folded in), as
non-persistent buffers of the layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    LinearMethod,
    RowParallelLinear,
)
from engine.lora.errors import LoRAAdapterError

if TYPE_CHECKING:
    from engine.kernels.registry import Kernels
    from engine.lora.mapping import LoRABatchMapping
    from engine.lora.peft import LoRAModuleWeights


class LoRALinearMethod(LinearMethod):
    """The base method, then the batch's adapters on every output slice (see the module
    docstring). One instance per wrapped layer: it knows the layer's slot buffers."""

    def __init__(
        self,
        base: LinearMethod,
        layer: LinearBase,
        mapping: LoRABatchMapping,
        kernels: Kernels | None,
    ) -> None:
        self.base = base
        self.mapping = mapping
        self.name = f"{base.name} + LoRA"
        self.slice_sizes = tuple(int(s) for s in layer.output_partition_sizes)
        self._add = _add_lora_op(kernels)

    def create_weights(self, layer: LinearBase) -> None:
        raise RuntimeError("LoRALinearMethod wraps a layer whose weights already exist")

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        self.base.process_weights_after_loading(layer)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.base.apply(layer, x, bias)
        mapping = self.mapping
        if not mapping.active:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        t = x2.shape[0]
        self._add(
            y2,
            x2,
            layer.lora_a_stacked,
            layer.lora_b_stacked,
            mapping.token_slots[:t],
            mapping.sorted_tokens[:t],
            mapping.slot_starts,
            self.slice_sizes,
        )
        return y


def _add_lora_op(kernels: Kernels | None):
    if kernels is not None and hasattr(kernels, "add_lora_linear"):
        return kernels.add_lora_linear
    from engine.kernels.reference import add_lora_linear

    return add_lora_linear


@dataclass
class LoRALayerTarget:
    """How one wrapped layer's slots are filled from an adapter.

    ``slice_modules[s]`` is the PEFT module name whose A/B feed output slice ``s``
    (``...q_proj`` for slice 0 of ``...qkv_proj``)."""

    name: str
    layer: LinearBase
    slice_modules: list[str]

    def lora_a(self) -> torch.Tensor:
        return self.layer.lora_a_stacked

    def lora_b(self) -> torch.Tensor:
        return self.layer.lora_b_stacked

    # -- checking and sharding one adapter's tensors -------------------------------------------
    def shard(
        self, adapter: str, slice_index: int, weights: LoRAModuleWeights, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(A, scaling * B)`` of one slice, checked against the layer's shape and
        cast to ``dtype``: A ``[r, in_r]``, B ``[out_r, r]``."""
        layer, module = self.layer, self.slice_modules[slice_index]
        a, b = weights.lora_a, weights.lora_b
        in_full = layer.input_size
        out_full = layer.output_full_sizes[slice_index]
        if tuple(a.shape[1:]) != (in_full,) or tuple(b.shape[:1]) != (out_full,):
            raise LoRAAdapterError(
                f"LoRA adapter {adapter!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, but the model's {module} maps {in_full} to {out_full} features "
                f"(expected [r, {in_full}] and [{out_full}, r]): the adapter was trained for "
                "another model"
            )
        if isinstance(layer, RowParallelLinear) and layer.tp_size > 1:
            part = layer.input_size_per_partition
            a = a.narrow(1, layer.tp_rank * part, part)
        elif isinstance(layer, ColumnParallelLinear) and layer.tp_size > 1:
            part = layer.output_partition_sizes[slice_index]
            b = b.narrow(0, layer._shard_rank(slice_index) * part, part)
        b = b.float() * weights.scaling
        return a.to(dtype).contiguous(), b.to(dtype).contiguous()


def wrap_layer(
    layer: LinearBase,
    num_slots: int,
    max_rank: int,
    mapping: LoRABatchMapping,
    kernels: Kernels | None,
) -> LoRALinearMethod:
    """Give ``layer`` its slot buffers and swap its method for a ``LoRALinearMethod`` around
    the current one (idempotent)."""
    if isinstance(layer.quant_method, LoRALinearMethod):
        return layer.quant_method
    device = _layer_device(layer)
    dtype = _layer_dtype(layer)
    num_slices = len(layer.output_partition_sizes)
    a = torch.zeros(
        (num_slots, num_slices * max_rank, layer.input_size_per_partition),
        dtype=dtype,
        device=device,
    )
    b = torch.zeros(
        (num_slots, layer.output_size_per_partition, max_rank), dtype=dtype, device=device
    )
    layer.register_buffer("lora_a_stacked", a, persistent=False)
    layer.register_buffer("lora_b_stacked", b, persistent=False)
    method = LoRALinearMethod(layer.quant_method, layer, mapping, kernels)
    layer.quant_method = method
    return method


def _layer_device(layer: LinearBase) -> torch.device:
    for tensor in list(layer.parameters(recurse=False)) + list(layer.buffers(recurse=False)):
        return tensor.device
    raise ValueError(f"{layer.prefix or type(layer).__name__} has no parameters")


def _layer_dtype(layer: LinearBase) -> torch.dtype:
    """The activation dtype: the layer's ``params_dtype`` (quantized weights have their own)."""
    if layer.params_dtype is not None:
        return layer.params_dtype
    return next(p.dtype for p in layer.parameters(recurse=False) if p.is_floating_point())
