"""Weight-only integer linear layers (W4A16 / W8A16): GPTQ, AWQ and compressed-tensors
pack-quantized checkpoints share one method after loading.

Each format's ``WNA16LinearMethod`` subclass creates the checkpoint's own tensors (with the
``ShardLayout`` that shards them under tensor parallelism) and converts them, once all arrived,
into the canonical form of ``engine.kernels.quantized.WNA16Linear``: uint8 values ``[N, K]``,
scales and integer zero points ``[N, K / group]``, and for act-order checkpoints the input
permutation. The platform's ``wna16_linear`` kernel then ``prepack``s them into its own layout
(the CPU's int4 tiles for ``_weight_int4pack_mm_for_cpu``, engine-triton's ``[K / 8, N]``
int32 for its split-K GEMV, ...), and only that packed copy stays in memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.layers.linear import LinearMethod
from engine.layers.weight_utils import ModelLoadError, init_dummy_parameter
from engine.quantization.base import QuantizationError
from engine.quantization.utils import kernel, replace_param

if TYPE_CHECKING:
    from engine.layers.linear import LinearBase

SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128, -1)
# Dequantized dummy weights of std ~0.02: uniform 4-bit values around the zero point have a
# std of ~4.6 (8-bit: ~74).
_DUMMY_SCALE = {4: 0.02 / 4.6, 8: 0.02 / 74.0}


class WNA16LinearMethod(LinearMethod):
    """Base of the weight-only integer formats: ``bits``-bit values in groups of
    ``group_size`` input features (-1: one group per output row)."""

    name = "wna16"
    #: parameter names this format loads (dropped once packed)
    checkpoint_params: tuple[str, ...] = ()

    def __init__(self, bits: int, group_size: int, *, act_order: bool = False) -> None:
        if bits not in SUPPORTED_BITS:
            raise QuantizationError(f"{bits}-bit weights are not supported (supported: 4, 8)")
        self.bits = bits
        self.group_size = group_size
        self.act_order = act_order
        self.pack = 32 // bits

    # -- sizes --------------------------------------------------------------------------------
    def groups(self, layer: LinearBase) -> int:
        """Scale groups along this rank's input features."""
        k = layer.input_size_per_partition
        return 1 if self.group_size == -1 else k // self.group_size

    def group_input_dim(self, layer: LinearBase, dim: int) -> int | None:
        """The scale tensors' input dimension for sharding: None (every rank keeps all groups)
        with one group per row, or with act-order under row parallelism, whose ranks' features
        fall in any group."""
        if self.group_size == -1:
            return None
        if self.act_order and layer.input_size_per_partition != layer.input_size:
            return None
        return dim

    def check_sizes(self, layer: LinearBase) -> None:
        k = layer.input_size_per_partition
        if self.group_size != -1 and k % self.group_size:
            raise QuantizationError(
                f"{layer.prefix}: {k} input features are not a multiple of the group size "
                f"{self.group_size}"
            )
        if k % self.pack:
            raise QuantizationError(
                f"{layer.prefix}: {k} input features do not pack {self.pack} to an int32"
            )

    # -- the format's part ---------------------------------------------------------------------
    #: The checkpoint's names of the packed values, the scales and the zero points (None: the
    #: format stores none, symmetric), by role: ``canonical_tensor`` converts each, and the
    #: MoE method (``engine.quantization.wna16_moe``) loads experts' tensors of these names.
    tensor_names: dict[str, str | None] = {}
    #: Other per-module tensors a checkpoint may carry, which an MoE expert reads and drops
    #: (GPTQ's ``g_idx`` without act-order, compressed-tensors' ``weight_shape``).
    extra_tensor_names: tuple[str, ...] = ()
    #: The checkpoint's name of the act-order group index (``g_idx`` ``[K]``), if it has one.
    g_idx_name: str | None = None

    def canonical_tensor(self, role: str, tensor: torch.Tensor) -> torch.Tensor:
        """One checkpoint tensor of ``role`` in canonical form: ``"qweight"`` -> uint8
        ``[N, K]``, ``"scales"`` -> ``[N, G]`` (its dtype), ``"zeros"`` -> uint8 ``[N, G]``."""
        raise NotImplementedError

    def canonical(
        self, layer: LinearBase
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(qweight uint8 [N, K], scales [N, G], zeros uint8 [N, G], g_idx int [K] or None)
        from the loaded checkpoint tensors."""
        raise NotImplementedError

    def init_dummy_weights(self, layer: LinearBase, generator: torch.Generator) -> None:
        """Random packed values, zero points at the middle of the range, positive scales
        (``dummy_value``), then the loader's rule for anything else (a bias)."""
        for name, param in layer.named_parameters(recurse=False):
            value = self.dummy_value(layer, name, param, generator)
            if value is None:
                init_dummy_parameter(name, param, generator)
            else:
                param.data.copy_(value)

    def dummy_value(
        self, layer: LinearBase, name: str, param: torch.Tensor, generator: torch.Generator
    ) -> torch.Tensor | None:
        """A dummy value for checkpoint parameter ``name``, or None for the loader's rule."""
        raise NotImplementedError

    @property
    def dummy_scale(self) -> float:
        return _DUMMY_SCALE[self.bits]

    def packed_word(self, value: int) -> int:
        """The int32 (signed) holding ``value`` in every one of its ``32 / bits`` positions."""
        word = 0
        for i in range(self.pack):
            word |= value << (i * self.bits)
        return word - (1 << 32) if word >= 1 << 31 else word

    # -- after loading -------------------------------------------------------------------------
    def process_weights_after_loading(self, layer: LinearBase) -> None:
        qweight, scales, zeros, g_idx = self.canonical(layer)
        n, k = layer.output_size_per_partition, layer.input_size_per_partition
        group = k if self.group_size == -1 else self.group_size
        perm = None
        if g_idx is not None:
            perm, scales, zeros = self._act_order(layer, g_idx, scales, zeros, group)
            if perm is not None:
                qweight = qweight.index_select(1, perm)
        if tuple(qweight.shape) != (n, k) or scales.shape != zeros.shape:
            raise ModelLoadError(
                f"{layer.prefix}: unpacked weights {tuple(qweight.shape)} / scales "
                f"{tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not fit [{n}, {k}]"
            )
        if not bool(torch.isfinite(scales).all()):
            raise ModelLoadError(f"{layer.prefix}: non-finite weight scales in the checkpoint")
        for name in self.checkpoint_params:
            replace_param(layer, name, None)
        op = kernel(layer, "wna16_linear")
        packed = op.prepack(
            qweight.contiguous(),
            scales.contiguous(),
            zeros.contiguous(),
            bits=self.bits,
            group_size=group,
            perm=perm,
            dtype=layer.params_dtype,
        )
        self.packed_names = []
        for key, tensor in packed.items():
            replace_param(layer, f"wna16_{key}", tensor)
            self.packed_names.append(key)
        self.kernel_group = group

    def _act_order(
        self,
        layer: LinearBase,
        g_idx: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group: int,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """The input permutation of an act-order checkpoint: features sorted by group, so each
        group is contiguous again (None when ``g_idx`` is already the plain order)."""
        k = g_idx.numel()
        g_idx = g_idx.to(torch.int64)
        plain = torch.arange(k, device=g_idx.device) // group
        if torch.equal(g_idx, plain):
            return None, scales, zeros
        perm = torch.argsort(g_idx, stable=True)
        sorted_groups = g_idx[perm]
        if not torch.equal(sorted_groups, plain):
            raise ModelLoadError(
                f"{layer.prefix}: act-order g_idx does not put exactly {group} input features "
                "in each group (this rank's shard of an act-order checkpoint under tensor "
                "parallelism, or a malformed g_idx); not supported"
            )
        return perm, scales, zeros

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed = {key: getattr(layer, f"wna16_{key}") for key in self.packed_names}
        return kernel(layer, "wna16_linear")(
            x, packed, bits=self.bits, group_size=self.kernel_group, bias=bias
        )
