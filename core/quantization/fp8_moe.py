"""FP8 (e4m3) mixture-of-experts weights: ``Fp8MoEMethod``, the ``FusedMoE`` method the ``fp8``
quantization config gives MoE layers (Qwen3-MoE, Qwen2-MoE, Mixtral).

Three ways in, one or two ways to multiply:

* ``--quantization fp8`` on a bf16/fp16 checkpoint (online): the experts load in the model
  dtype as unquantized ones do and are quantized after loading, each expert's rows to e4m3
  with one float32 scale per output channel (``w13_weight_scale`` ``[E, 2I]``,
  ``w2_weight_scale`` ``[E, H]``), as the dense online method does;
* an ``fp8`` checkpoint with ``weight_block_size`` (Qwen3-30B-A3B-FP8 and kin: 128x128
  ``weight_scale_inv`` per expert projection): the per-expert scales are stacked as the
  weights are, the gate's block rows then the up projection's (``w13_weight_scale_inv``
  ``[E, 2 * ceil(I / bn), ceil(H / bk)]``, ``w2_weight_scale_inv``
  ``[E, ceil(H / bn), ceil(I / bk)]``); partial last blocks are fine on one rank, tensor
  parallelism needs every rank's intermediate slice to be whole blocks;
* an ``fp8`` checkpoint with per-tensor scales (``weight_scale``, one per expert projection;
  static ``input_scale`` read and dropped): the scales are expanded to per-channel after
  loading, which is exact.

Either way the experts run through the platform's ``fused_moe_fp8`` kernel **weight-only**:
the activations stay in the model dtype (no W8A8 for experts), which halves the bytes of
expert weights read per step, what decode is bound by. On the CPU that kernel is the torch
reference, which dequantizes each routed expert on every call (correct, slow; logged). A GPU
platform whose only ``fused_moe_fp8`` is the torch reference is refused at build time.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.kernels.quantized import FP8_DTYPE
from engine.layers.fused_moe import FusedMoEMethodBase, host_loop_problem
from engine.layers.weight_utils import (
    ModelLoadError,
    check_shape,
    materialize,
    narrow,
    new_parameter,
    set_weight_loader,
)
from engine.quantization.base import QuantizationError
from engine.quantization.utils import quantize_fp8_per_channel, random_fp8, replace_param

if TYPE_CHECKING:
    from engine.layers.fused_moe import FusedMoE

logger = logging.getLogger(__name__)

_DUMMY_STD = 64.0
_DUMMY_SCALE = 0.02 / _DUMMY_STD


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_fp8_experts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked experts ``[E, N, K]`` -> (e4m3 ``[E, N, K]``, float32 ``[E, N]``): each expert's
    rows scaled so that their largest magnitude maps to 448. One expert at a time, so the
    float32 working copy is one expert's."""
    q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
    for e in range(weight.shape[0]):
        q[e], scale[e] = quantize_fp8_per_channel(weight[e])
    return q, scale


def quantize_fp8_experts_blocks(
    weight: torch.Tensor, block_size: tuple[int, int], slices: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked experts ``[E, N, K]`` -> (e4m3, float32 block scales) in ``fused_moe_fp8``'s
    layout: each ``(bn, bk)`` block's largest magnitude maps to 448, the rows cut into
    ``slices`` equal parts with blocks of their own (w13: 2, gate then up), partial last
    blocks allowed. For tests and benchmarks (checkpoints bring their own)."""
    bn, bk = int(block_size[0]), int(block_size[1])
    e, n, k = weight.shape
    part = n // slices
    qs, ss = [], []
    for s in range(slices):
        w = weight[:, s * part : (s + 1) * part].float()
        rows, cols = _cdiv(part, bn), _cdiv(k, bk)
        padded = torch.zeros(e, rows * bn, cols * bk, device=w.device)
        padded[:, :part, :k] = w
        tiles = padded.view(e, rows, bn, cols, bk)
        scale = (tiles.abs().amax(dim=(2, 4)) / 448.0).clamp(min=torch.finfo(torch.float32).tiny)
        q = (tiles / scale[:, :, None, :, None]).clamp(-448.0, 448.0).to(FP8_DTYPE)
        qs.append(q.view(e, rows * bn, cols * bk)[:, :part, :k])
        ss.append(scale)
    return torch.cat(qs, 1).contiguous(), torch.cat(ss, 1).contiguous()


class Fp8MoEMethod(FusedMoEMethodBase):
    """FP8 experts (see the module docstring). ``serialized``: the checkpoint stores e4m3
    expert weights (else they are quantized after loading, per channel); ``block_size``: the
    checkpoint's ``weight_block_size``, its scales named ``scale_name`` (``weight_scale_inv``
    in the fp8 format, ``weight_scale`` in compressed-tensors); otherwise, serialized,
    ``weight_scheme`` ``"tensor"`` (one scale per expert projection) or ``"channel"``
    (compressed-tensors' ``[N, 1]`` per output channel), named ``weight_scale``."""

    def __init__(
        self,
        *,
        serialized: bool,
        block_size: tuple[int, int] | None = None,
        weight_scheme: str = "tensor",
        scale_name: str = "weight_scale_inv",
        name: str = "fp8",
    ) -> None:
        if weight_scheme not in ("tensor", "channel"):
            raise ValueError(f"weight_scheme must be 'tensor' or 'channel', got {weight_scheme!r}")
        self.serialized = serialized
        self.block_size = (int(block_size[0]), int(block_size[1])) if block_size else None
        self.weight_scheme = weight_scheme
        self.scale_name = scale_name if self.block_size else "weight_scale"
        self.name = name
        # A static-activation checkpoint's input_scale: the experts run weight-only.
        self.ignored_checkpoint_suffixes = ("input_scale",) if serialized else ()

    @property
    def scheme(self) -> str:
        if not self.serialized:
            return "online, per-channel scales"
        if self.block_size:
            return f"{self.block_size[0]}x{self.block_size[1]} block scales"
        return f"per-{self.weight_scheme} scales"

    # ---- parameters ---------------------------------------------------------------------
    def create_weights(
        self,
        layer: FusedMoE,
        num_local_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        dtype: torch.dtype | None,
    ) -> None:
        e, h, ip = num_local_experts, hidden_size, intermediate_size_per_partition
        wdtype = FP8_DTYPE if self.serialized else dtype
        self._add(layer, "w13", "weight", (e, 2 * ip, h), wdtype, layer.weight_loader)
        self._add(layer, "w2", "weight", (e, h, ip), wdtype, layer.weight_loader)
        if not self.serialized:
            return
        if self.block_size is None and self.weight_scheme == "channel":
            loader = functools.partial(self._load_channel_scale, layer)
            self._add(layer, "w13", "weight_scale", (e, 2 * ip), torch.float32, loader)
            self._add(layer, "w2", "weight_scale", (e, h), torch.float32, loader)
            return
        if self.block_size is None:
            loader = functools.partial(self._load_tensor_scale, layer)
            self._add(layer, "w13", "weight_scale", (e, 2), torch.float32, loader)
            self._add(layer, "w2", "weight_scale", (e, 1), torch.float32, loader)
            return
        bn, bk = self.block_size
        if layer.parallel.tp_size > 1 and (ip % bn or ip % bk):
            raise QuantizationError(
                f"{layer.prefix}: each rank's {ip} of the experts' {layer.intermediate_size} "
                f"intermediate features (tensor-parallel size {layer.parallel.tp_size}) are not "
                f"whole {bn}x{bk} FP8 weight blocks; use a tensor-parallel size that splits "
                "the experts on block boundaries, or expert parallelism"
            )
        loader = functools.partial(self._load_block_scale, layer)
        shape13 = (e, 2 * _cdiv(ip, bn), _cdiv(h, bk))
        self._add(layer, "w13", self.scale_name, shape13, torch.float32, loader)
        shape2 = (e, _cdiv(h, bn), _cdiv(ip, bk))
        self._add(layer, "w2", self.scale_name, shape2, torch.float32, loader)

    @staticmethod
    def _add(layer, kind, suffix, shape, dtype, loader) -> nn.Parameter:
        param = new_parameter(shape, dtype)
        param.moe_shard_kind = kind  # type: ignore[attr-defined]
        param.checkpoint_suffix = suffix  # type: ignore[attr-defined]
        set_weight_loader(param, loader)
        layer.register_parameter(f"{kind}_{suffix}", param)
        return param

    def _load_tensor_scale(
        self, layer: FusedMoE, param: nn.Parameter, loaded: Any, shard_id: str, expert_id=None
    ) -> None:
        local = layer.local_expert(f"{shard_id} weight_scale", expert_id)
        if local is None:
            return
        if math.prod(tuple(loaded.shape)) != 1:
            raise ModelLoadError(
                f"{shard_id} weight_scale: expected a per-tensor scale (one element), got shape "
                f"{tuple(loaded.shape)}"
            )
        column = {"w1": 0, "w3": 1, "w2": 0}.get(shard_id)
        if column is None or (param.moe_shard_kind == "w2") != (shard_id == "w2"):
            raise ModelLoadError(f"shard {shard_id!r} does not fit {param.moe_shard_kind} scales")
        param.data[local, column].copy_(materialize(loaded).reshape(()))

    def _load_channel_scale(
        self, layer: FusedMoE, param: nn.Parameter, loaded: Any, shard_id: str, expert_id=None
    ) -> None:
        local = layer.local_expert(f"{shard_id} weight_scale", expert_id)
        if local is None:
            return
        h, i = layer.hidden_size, layer.intermediate_size
        ip, rank = layer.intermediate_size_per_partition, layer.parallel.tp_rank
        rows = h if shard_id == "w2" else i
        if tuple(loaded.shape) not in ((rows,), (rows, 1)):
            raise ModelLoadError(
                f"{shard_id} weight_scale: expected per-channel scales of shape ({rows}, 1), got "
                f"{tuple(loaded.shape)}"
            )
        kind = param.moe_shard_kind
        dst = param.data[local]
        if kind == "w13" and shard_id in ("w1", "w3"):
            src = materialize(narrow(loaded, 0, rank * ip, ip)).reshape(ip)
            dst.narrow(0, 0 if shard_id == "w1" else ip, ip).copy_(src)
        elif kind == "w2" and shard_id == "w2":
            dst.copy_(materialize(loaded).reshape(h))  # output channels: not split
        else:
            raise ModelLoadError(f"shard {shard_id!r} does not fit {kind} scales")

    def _load_block_scale(
        self, layer: FusedMoE, param: nn.Parameter, loaded: Any, shard_id: str, expert_id=None
    ) -> None:
        local = layer.local_expert(f"{shard_id} {self.scale_name}", expert_id)
        if local is None:
            return
        assert self.block_size is not None
        bn, bk = self.block_size
        h, i = layer.hidden_size, layer.intermediate_size
        ip, rank = layer.intermediate_size_per_partition, layer.parallel.tp_rank
        dst = param.data[local]
        kind = param.moe_shard_kind
        if kind == "w13" and shard_id in ("w1", "w3"):
            check_shape(f"{shard_id} block scales", (_cdiv(i, bn), _cdiv(h, bk)), loaded.shape)
            rows = _cdiv(ip, bn)
            src = materialize(narrow(loaded, 0, rank * ip // bn, rows))
            dst.narrow(0, 0 if shard_id == "w1" else rows, rows).copy_(src)
        elif kind == "w2" and shard_id == "w2":
            check_shape("w2 block scales", (_cdiv(h, bn), _cdiv(i, bk)), loaded.shape)
            dst.copy_(materialize(narrow(loaded, 1, rank * ip // bk, _cdiv(ip, bk))))
        else:
            raise ModelLoadError(f"shard {shard_id!r} does not fit {kind} block scales")

    def init_dummy_weights(self, layer: FusedMoE, generator: torch.Generator) -> None:
        """``--load-format dummy`` with an FP8 checkpoint config: random e4m3 experts of the
        dense method's scale (dequantized std 0.02), so FP8 MoE shapes can be benchmarked."""
        for param in layer.parameters(recurse=False):
            if param.dtype == FP8_DTYPE:
                param.data.copy_(random_fp8(param.shape, _DUMMY_STD, generator, param.device))
            elif getattr(param, "moe_shard_kind", None) is not None:
                param.data.fill_(_DUMMY_SCALE)

    # ---- after loading ------------------------------------------------------------------
    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        if not self.serialized:
            for kind in ("w13", "w2"):
                q, scale = quantize_fp8_experts(getattr(layer, f"{kind}_weight").data)
                replace_param(layer, f"{kind}_weight", q)
                replace_param(layer, f"{kind}_weight_scale", scale)
        elif self.block_size is None and self.weight_scheme == "tensor":
            # Per-tensor (w1, w3 | w2) -> per output channel: exact, and one kernel mode.
            ip, h = layer.intermediate_size_per_partition, layer.hidden_size
            s13 = layer.w13_weight_scale.data.float().repeat_interleave(ip, dim=1)
            s2 = layer.w2_weight_scale.data.float().expand(-1, h)
            replace_param(layer, "w13_weight_scale", s13.contiguous())
            replace_param(layer, "w2_weight_scale", s2.contiguous())
        for kind in ("w13", "w2"):
            scale = self._scale(layer, kind)
            if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
                raise ModelLoadError(
                    f"{layer.prefix}: FP8 expert {kind} scales must be finite and > 0"
                )

    def _scale(self, layer: FusedMoE, kind: str) -> torch.Tensor:
        return getattr(layer, f"{kind}_{self.scale_name}")

    # ---- compute ------------------------------------------------------------------------
    def graph_capture_problem(self, layer: FusedMoE) -> str | None:
        return host_loop_problem(layer, "fused_moe_fp8")

    def apply(
        self,
        layer: FusedMoE,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        block = self.block_size if self.serialized else None
        return layer.kernels.fused_moe_fp8(
            hidden,
            layer.w13_weight,
            layer.w2_weight,
            topk_weights,
            topk_ids,
            self._scale(layer, "w13"),
            self._scale(layer, "w2"),
            block,
        )


def fp8_moe_method(config: Any, layer: Any, prefix: str, **kwargs: Any) -> Fp8MoEMethod:
    """An ``Fp8MoEMethod(**kwargs)`` for the FP8 quantization ``config`` (fp8,
    compressed-tensors) of the MoE layer ``prefix``: refused on a GPU platform whose only
    ``fused_moe_fp8`` is the torch reference; the first one of a config logs how its experts
    run."""
    kernels = getattr(layer, "kernels", None)
    platform = getattr(kernels, "platform", None)
    if kernels is not None and platform != "cpu" and kernels.is_reference("fused_moe_fp8"):
        raise QuantizationError(
            f"{prefix}: no plugin provides fused_moe_fp8 on {platform}: only the torch "
            "reference does, which dequantizes every routed expert on every call (install "
            "engine-triton, or a vendor plugin that registers it)"
        )
    method = Fp8MoEMethod(**kwargs)
    if not getattr(config, "_moe_logged", False):
        config._moe_logged = True
        where = "fused_moe_fp8"
        if kernels is not None:
            where = f"{kernels.provider('fused_moe_fp8')}'s fused_moe_fp8"
            if kernels.is_reference("fused_moe_fp8"):
                where += ", which dequantizes each routed expert per call (slow)"
        logger.info(
            "%s: MoE experts are FP8 (%s), multiplied weight-only by %s: activations stay in "
            "the model dtype (no W8A8 for experts)",
            getattr(config, "name", "fp8"),
            method.scheme,
            where,
        )
    return method
