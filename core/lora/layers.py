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

**The shrink in the base GEMM** (``fuse_shrink``; on GPUs by default, for unquantized layers).
The A slots are then the last rows of one *augmented* weight ``[W; A_0; ...; A_{slots-1}]``
(``layer.weight`` is a view of its first rows, so nothing else changes): a step with adapters
runs one GEMM ``x @ W_aug^T`` that yields the base output and every slot's shrunk values, and
one ``lora_expand_augmented`` launch that adds each token's own slot's expand into a fresh
output. The extra rows are a few percent of the weight (``slots * S * R``: 384 on Llama-3.1-8B's
6144-row q/k/v with 8 slots of rank 16), read as part of a GEMM that streams the weight anyway,
where a separate shrink launch costs a kernel's fixed latency per projection, which dominates
decode steps of few tokens. Steps without adapters multiply by ``W`` alone. Quantized and
CPU-packed layers keep the separate shrink (``add_lora_linear``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.layers.linear import (
    UNQUANTIZED,
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
        augmented: torch.Tensor | None = None,
    ) -> None:
        """``augmented``: the layer's weight with the A slots appended (the shrink runs in
        the base GEMM), or None (a separate shrink)."""
        self.base = base
        self.mapping = mapping
        self.name = f"{base.name} + LoRA" + (
            " (shrink in the GEMM)" if augmented is not None else ""
        )
        self.slice_sizes = tuple(int(s) for s in layer.output_partition_sizes)
        self.out_features = sum(self.slice_sizes)
        self.augmented = augmented
        self._bias_aug: torch.Tensor | None = None
        if augmented is not None and layer.bias is not None:
            extra = augmented.shape[0] - self.out_features
            self._bias_aug = torch.cat([layer.bias.data, layer.bias.data.new_zeros(extra)])
        self._add = _op(kernels, "add_lora_linear")
        self._expand = _op(kernels, "lora_expand_augmented")

    def create_weights(self, layer: LinearBase) -> None:
        raise RuntimeError("LoRALinearMethod wraps a layer whose weights already exist")

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        self.base.process_weights_after_loading(layer)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        mapping = self.mapping
        if self.augmented is not None and mapping.active:
            return self._apply_augmented(layer, x, bias)
        y = self.base.apply(layer, x, bias)
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

    def _apply_augmented(
        self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        mapping = self.mapping
        x2 = x.reshape(-1, x.shape[-1])
        t = x2.shape[0]
        y_aug = layer.linear_op(x2, self.augmented, self._bias_aug if bias is not None else None)
        y = self._expand(
            y_aug,
            self.out_features,
            layer.lora_b_stacked,
            mapping.token_slots[:t],
            mapping.sorted_tokens[:t],
            mapping.slot_starts,
            self.slice_sizes,
        )
        return y.view(*x.shape[:-1], self.out_features)


def _op(kernels: Kernels | None, name: str):
    if kernels is not None and hasattr(kernels, name):
        return getattr(kernels, name)
    from engine.kernels import reference

    return getattr(reference, name)


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


def can_fuse_shrink(layer: LinearBase) -> bool:
    """Whether the layer's shrink can run in its base GEMM: an unquantized layer with a plain
    contiguous ``[out, in]`` weight in the activation dtype."""
    weight = getattr(layer, "weight", None)
    return (
        layer.quant_method is UNQUANTIZED
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.is_contiguous()
        and tuple(weight.shape) == (layer.output_size_per_partition, layer.input_size_per_partition)
        and weight.dtype == _layer_dtype(layer)
    )


def wrap_layer(
    layer: LinearBase,
    num_slots: int,
    max_rank: int,
    mapping: LoRABatchMapping,
    kernels: Kernels | None,
    fuse_shrink: bool = False,
) -> LoRALinearMethod:
    """Give ``layer`` its slot buffers and swap its method for a ``LoRALinearMethod`` around
    the current one (idempotent). With ``fuse_shrink`` (and a layer that allows it) the A
    slots are appended to the weight: see the module docstring."""
    if isinstance(layer.quant_method, LoRALinearMethod):
        return layer.quant_method
    device = _layer_device(layer)
    dtype = _layer_dtype(layer)
    num_slices = len(layer.output_partition_sizes)
    a_shape = (num_slots, num_slices * max_rank, layer.input_size_per_partition)
    augmented = None
    if fuse_shrink and can_fuse_shrink(layer):
        out, extra = layer.output_size_per_partition, num_slots * num_slices * max_rank
        augmented = torch.zeros((out + extra, a_shape[2]), dtype=dtype, device=device)
        augmented[:out].copy_(layer.weight.data)
        layer.weight.data = augmented[:out]  # the parameter now lives in the augmented weight
        a = augmented[out:].view(a_shape)
    else:
        a = torch.zeros(a_shape, dtype=dtype, device=device)
    b = torch.zeros(
        (num_slots, layer.output_size_per_partition, max_rank), dtype=dtype, device=device
    )
    layer.register_buffer("lora_a_stacked", a, persistent=False)
    layer.register_buffer("lora_b_stacked", b, persistent=False)
    method = LoRALinearMethod(layer.quant_method, layer, mapping, kernels, augmented)
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
