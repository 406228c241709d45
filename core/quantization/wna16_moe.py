"""4- and 8-bit integer mixture-of-experts weights (W4A16 / W8A16): ``WNA16MoEMethod``, the
``FusedMoE`` method of GPTQ, AWQ and compressed-tensors ``pack-quantized`` checkpoints
(Qwen3-MoE, Qwen2-MoE, Mixtral).

Checkpoints store every expert's projections as separate modules in the dense format
(``experts.7.gate_proj.qweight`` / ``qzeros`` / ``scales`` / ``g_idx`` for GPTQ, Mixtral's
``experts.7.w1.*``; AWQ's ``qweight`` / ``qzeros`` / ``scales``; compressed-tensors'
``weight_packed`` / ``weight_scale`` / ``weight_zero_point`` / ``weight_shape``). Each tensor is
converted as it arrives, by the dense method's own ``canonical_tensor`` (GPTQ's, AWQ's or
compressed-tensors' unpacking, ``engine.quantization.wna16``), to the canonical values
``[N, K]`` / scales and zero points ``[N, G]``, cut to this rank's part under tensor
parallelism and repacked into the stacked layout ``fused_moe_wna16`` reads
(``engine.kernels.reference.fused_moe_wna16``):

* ``w13_<qweight>`` int32 ``[E, 2I, H * bits / 32]``, ``w2_<qweight>`` int32
  ``[E, H, I * bits / 32]``: values packed along the input features, lowest bits first;
* ``w13_<scales>`` float32 ``[E, 2I, H / g]``, ``w2_<scales>`` ``[E, H, I / g]``;
* ``w13_<zeros>`` / ``w2_<zeros>`` uint8, the same shapes (absent for compressed-tensors'
  symmetric schemes: zero point ``2**(bits-1)``),

``<name>`` being the checkpoint's (``w13_qweight`` for GPTQ, ``w13_weight_packed`` for
compressed-tensors). Only the packed copy is ever held (half a byte per 4-bit weight).

Tensor parallelism shards each expert's intermediate features: w13 by rows, w2 by input
features, and a w2 scale group must lie within one rank (each rank's ``I / tp`` a multiple of
the group size; one group per row is fine, every rank keeping its scale), refused at build
otherwise, with what would work. Expert parallelism places whole experts, with no constraint.

Act-order checkpoints (GPTQ ``desc_act``, compressed-tensors ``actorder`` group/weight) give
every expert its own order of its input features (``g_idx`` per expert projection; the gate's
and the up projection's must agree, as GPTQ makes them: they read the same input). After
loading, each expert's features are sorted by group (the dense methods' ``_act_order``), its
packed values repacked in that order, and the permutation kept as ``w13_perm`` ``[E, H]`` /
``w2_perm`` ``[E, I]``, through which the kernel reads the activations. Under tensor
parallelism with groups a rank's share of the down projection's inputs falls in any group:
refused at build (expert parallelism keeps whole experts and works).

Refused otherwise: 3-bit and other widths, group sizes other than 32/64/128/-1 (the dense
formats' own refusals), experts whose three projections have different settings.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.kernels.quantized import dequantize_wna16_experts
from engine.layers.fused_moe import FusedMoEMethodBase, host_loop_problem
from engine.layers.weight_utils import ModelLoadError, materialize, new_parameter, set_weight_loader
from engine.quantization.base import QuantizationError
from engine.quantization.utils import fill_random_bits, pack_int32, replace_param, unpack_int32
from engine.quantization.wna16 import WNA16LinearMethod

if TYPE_CHECKING:
    from engine.layers.fused_moe import FusedMoE

logger = logging.getLogger(__name__)

ROLES = ("qweight", "scales", "zeros")


class WNA16MoEMethod(FusedMoEMethodBase):
    """Integer experts in groups (see the module docstring). ``fmt`` is the dense method of
    the checkpoint's format (``GPTQLinearMethod``, ``AWQLinearMethod``,
    ``CTWNA16LinearMethod``), whose bits, group size, act-order, tensor names,
    ``canonical_tensor`` conversion and act-order permutation (``_act_order``) the experts
    share."""

    #: The checkpoint stores the quantized values (the dummy loader asks this method for them).
    serialized = True

    def __init__(self, fmt: WNA16LinearMethod) -> None:
        self.fmt = fmt
        self.bits = fmt.bits
        self.group_size = fmt.group_size
        self.pack = 32 // fmt.bits
        self.act_order = fmt.act_order
        if self.act_order and fmt.g_idx_name is None:
            raise QuantizationError(f"{fmt.name}: act-order without a g_idx tensor")
        self.names = {role: fmt.tensor_names.get(role) for role in ROLES}
        self.g_idx_name = fmt.g_idx_name if self.act_order else None
        self.ignored_checkpoint_suffixes = tuple(
            n for n in fmt.extra_tensor_names if n != self.g_idx_name
        )
        self.name = fmt.name
        # (kind, local expert) of the g_idx loaded: w13's second (gate or up) must equal it.
        self._g_idx_seen: set[tuple[str, int]] = set()

    @property
    def symmetric(self) -> bool:
        """Whether the format stores no zero points (each is ``2**(bits-1)``)."""
        return self.names["zeros"] is None

    # ---- parameters ---------------------------------------------------------------------
    def _groups(self, features: int) -> int:
        return 1 if self.group_size == -1 else features // self.group_size

    def check_sizes(self, layer: FusedMoE, hidden: int, ip: int) -> None:
        """Refuse, with what would work, expert sizes the format or the split cannot hold."""
        inter, tp = layer.intermediate_size, layer.parallel.tp_size
        group = self.group_size
        for what, size in (("hidden size", hidden), ("expert intermediate size", inter)):
            if group != -1 and size % group:
                raise QuantizationError(
                    f"{layer.prefix}: the {what} {size} is not a multiple of the {self.name} "
                    f"group size {group}"
                )
            if size % self.pack:
                raise QuantizationError(
                    f"{layer.prefix}: the {what} {size} does not pack {self.pack} "
                    f"{self.bits}-bit values to an int32"
                )
        if tp > 1 and group != -1 and ip % group:
            fits = [n for n in range(2, tp + 1) if inter % (n * group) == 0]
            raise QuantizationError(
                f"{layer.prefix}: each rank's {ip} of the experts' {inter} intermediate "
                f"features (tensor-parallel size {tp}) would split a {group}-feature scale "
                f"group of the down projection across ranks; use a tensor-parallel size that "
                f"keeps whole groups ({', '.join(map(str, fits)) or 'none above 1'}), or "
                "expert parallelism (--enable-expert-parallel)"
            )
        if tp > 1 and ip % self.pack:
            raise QuantizationError(
                f"{layer.prefix}: each rank's {ip} intermediate features do not pack "
                f"{self.pack} values to an int32; use expert parallelism"
            )
        if tp > 1 and self.act_order and group != -1:
            raise QuantizationError(
                f"{layer.prefix}: act-order experts ({self.name}) split over {tp} "
                "tensor-parallel ranks: a rank's share of the down projection's input features "
                "falls in any scale group, and the fused kernels need each group contiguous; "
                "use expert parallelism (--enable-expert-parallel), which keeps experts whole"
            )

    def create_weights(
        self,
        layer: FusedMoE,
        num_local_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        dtype: torch.dtype | None,
    ) -> None:
        e, h, ip = num_local_experts, hidden_size, intermediate_size_per_partition
        self.check_sizes(layer, h, ip)
        p = self.pack
        shapes = {
            "w13": {"qweight": (e, 2 * ip, h // p), "scales": (e, 2 * ip, self._groups(h))},
            "w2": {"qweight": (e, h, ip // p), "scales": (e, h, self._groups(ip))},
        }
        dtypes = {"qweight": torch.int32, "scales": torch.float32, "zeros": torch.uint8}
        for kind, by_role in shapes.items():
            by_role["zeros"] = by_role["scales"]
            for role in ROLES:
                suffix = self.names[role]
                if suffix is None:
                    continue
                param = new_parameter(by_role[role], dtypes[role])
                param.moe_shard_kind = kind  # type: ignore[attr-defined]
                param.checkpoint_suffix = suffix  # type: ignore[attr-defined]
                param.wna16_role = role  # type: ignore[attr-defined]
                set_weight_loader(param, functools.partial(self._load, layer, role))
                layer.register_parameter(f"{kind}_{suffix}", param)
        if self.g_idx_name is not None:
            for kind, size in (("w13", h), ("w2", ip)):
                param = new_parameter((e, size), torch.int32)
                param.moe_shard_kind = kind  # type: ignore[attr-defined]
                param.checkpoint_suffix = self.g_idx_name  # type: ignore[attr-defined]
                param.wna16_role = "g_idx"  # type: ignore[attr-defined]
                set_weight_loader(param, functools.partial(self._load_g_idx, layer))
                layer.register_parameter(f"{kind}_{self.g_idx_name}", param)

    @staticmethod
    def _target(
        layer: FusedMoE, param: nn.Parameter, name: str, shard_id: str, expert_id: int | None
    ) -> tuple[int, str] | None:
        """(this rank's expert index, ``w13`` or ``w2``) that an expert projection's tensor
        ``name`` of ``shard_id`` fills, after checking the shard fits the parameter; None:
        another rank holds the expert."""
        local = layer.local_expert(f"{shard_id} {name}", expert_id)
        if local is None:
            return None
        kind = param.moe_shard_kind  # type: ignore[attr-defined]
        if (kind == "w2") != (shard_id == "w2") or shard_id not in ("w1", "w3", "w2"):
            raise ModelLoadError(f"shard {shard_id!r} does not fit {kind} {name}")
        return local, kind

    def _load_g_idx(
        self,
        layer: FusedMoE,
        param: nn.Parameter,
        loaded: Any,
        shard_id: str,
        expert_id: int | None = None,
    ) -> None:
        """An act-order expert projection's group index ``[K]``. The gate's and the up
        projection's read the same input, so GPTQ gave them the same order: the first is
        kept, a different second refused (one input order per expert's w13)."""
        target = self._target(layer, param, self.g_idx_name, shard_id, expert_id)
        if target is None:
            return
        local, kind = target
        size = layer.intermediate_size if kind == "w2" else layer.hidden_size
        if tuple(loaded.shape) != (size,):
            raise ModelLoadError(
                f"{shard_id} {self.g_idx_name}: expected shape ({size},), got {tuple(loaded.shape)}"
            )
        if param.device.type == "meta":  # a shapes-only pass: nothing to compare
            return
        value = materialize(loaded).to(torch.int32)
        if kind == "w2":  # this rank's input features (all of them but with one group per row)
            ip, rank = layer.intermediate_size_per_partition, layer.parallel.tp_rank
            value = value[rank * ip : (rank + 1) * ip]
        if (kind, local) in self._g_idx_seen:
            if not torch.equal(param.data[local], value):
                raise ModelLoadError(
                    f"{layer.prefix}: expert {expert_id}'s gate and up projections have "
                    "different act-order g_idx; one expert's gate/up need one input order"
                )
            return
        self._g_idx_seen.add((kind, local))
        param.data[local].copy_(value)

    def _load(
        self,
        layer: FusedMoE,
        role: str,
        param: nn.Parameter,
        loaded: Any,
        shard_id: str,
        expert_id: int | None = None,
    ) -> None:
        """One expert projection's checkpoint tensor of ``role``: converted to canonical form
        by the format, cut to this rank's part, packed into the stacked parameter."""
        suffix = self.names[role]
        target = self._target(layer, param, suffix, shard_id, expert_id)
        if target is None:
            return
        local, kind = target
        h, i = layer.hidden_size, layer.intermediate_size
        ip, rank = layer.intermediate_size_per_partition, layer.parallel.tp_rank
        rows, cols = (h, i) if kind == "w2" else (i, h)
        want = (rows, cols) if role == "qweight" else (rows, self._groups(cols))
        try:
            value = self.fmt.canonical_tensor(role, materialize(loaded))
        except RuntimeError as e:  # a packed dimension that does not unpack
            raise ModelLoadError(
                f"{shard_id} {suffix} of shape {tuple(loaded.shape)} does not unpack to "
                f"{want} ({self.name}): {e}"
            ) from None
        if tuple(value.shape) != want:
            raise ModelLoadError(
                f"{shard_id} {suffix} of shape {tuple(loaded.shape)} unpacks to "
                f"{tuple(value.shape)}, expected {want} ({self.name}, {rows}x{cols} weights)"
            )
        if kind == "w2":
            if role == "qweight":
                value = value[:, rank * ip : (rank + 1) * ip]
            elif self.group_size != -1:
                per = ip // self.group_size
                value = value[:, rank * per : (rank + 1) * per]
            dst = param.data[local]
        else:
            value = value[rank * ip : (rank + 1) * ip]
            dst = param.data[local].narrow(0, 0 if shard_id == "w1" else ip, ip)
        if role == "qweight":
            value = pack_int32(value, self.bits, dim=1)
        dst.copy_(value.to(dst.dtype))

    def init_dummy_weights(self, layer: FusedMoE, generator: torch.Generator) -> None:
        """``--load-format dummy`` with a quantized MoE config: random packed values, zero
        points mid-range, scales giving dequantized weights of std ~0.02 (the dense formats'
        dummy values), so real shapes can be benchmarked."""
        for param in layer.parameters(recurse=False):
            role = getattr(param, "wna16_role", None)
            if role == "qweight":
                fill_random_bits(param, generator)
            elif role == "scales":
                param.data.fill_(self.fmt.dummy_scale)
            elif role == "zeros":
                param.data.fill_(1 << (self.bits - 1))
            elif role == "g_idx":  # the plain order: no permutation
                group = param.shape[1] if self.group_size == -1 else self.group_size
                param.data.copy_(torch.arange(param.shape[1], dtype=torch.int32) // group)

    # ---- after loading ------------------------------------------------------------------
    def tensors(self, layer: FusedMoE, kind: str) -> tuple[torch.Tensor, ...]:
        """(packed values, scales, zero points or None) of ``kind`` (w13, w2)."""
        return tuple(
            None if self.names[r] is None else getattr(layer, f"{kind}_{self.names[r]}")
            for r in ROLES
        )

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        for kind in ("w13", "w2"):
            scales = self.tensors(layer, kind)[1]
            if not bool(torch.isfinite(scales).all()):
                raise ModelLoadError(f"{layer.prefix}: non-finite {kind} expert scales")
        self._g_idx_seen.clear()
        if self.g_idx_name is not None:
            self._apply_act_order(layer)

    def _apply_act_order(self, layer: FusedMoE) -> None:
        """Act-order experts: each expert's input features sorted by group (the dense method's
        ``_act_order``: each group contiguous again), the packed values repacked in that
        order and the permutation kept as ``<kind>_perm`` ``[E, K]`` for the kernel; none
        when every expert's ``g_idx`` is the plain order."""
        for kind in ("w13", "w2"):
            g_idx = getattr(layer, f"{kind}_{self.g_idx_name}").data
            qweight = getattr(layer, f"{kind}_{self.names['qweight']}")
            k = g_idx.shape[1]
            group = k if self.group_size == -1 else self.group_size
            perm = torch.arange(k, dtype=torch.int32, device=g_idx.device).repeat(len(g_idx), 1)
            permuted = False
            for e in range(len(g_idx)):
                order, _, _ = self.fmt._act_order(layer, g_idx[e], qweight, qweight, group)
                if order is None:
                    continue
                values = unpack_int32(qweight.data[e], self.bits, dim=1)
                qweight.data[e] = pack_int32(values.index_select(1, order), self.bits, dim=1)
                perm[e] = order.to(torch.int32)
                permuted = True
            replace_param(layer, f"{kind}_{self.g_idx_name}", None)
            replace_param(layer, f"{kind}_perm", perm if permuted else None)

    def dequantized(self, layer: FusedMoE, kind: str) -> torch.Tensor:
        """This rank's stacked experts of ``kind`` dequantized (float32 ``[E, N, K]``): for
        tests and debugging."""
        q, s, z = self.tensors(layer, kind)
        w = dequantize_wna16_experts(q, s, z, self.bits)
        perm = getattr(layer, f"{kind}_perm", None)
        if perm is None:
            return w
        out = torch.empty_like(w)
        out.scatter_(2, perm.long()[:, None, :].expand_as(w), w)  # stored k is input perm[k]
        return out

    # ---- compute ------------------------------------------------------------------------
    def graph_capture_problem(self, layer: FusedMoE) -> str | None:
        return host_loop_problem(layer, "fused_moe_wna16")

    def apply(
        self,
        layer: FusedMoE,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        q13, s13, z13 = self.tensors(layer, "w13")
        q2, s2, z2 = self.tensors(layer, "w2")
        p13, p2 = getattr(layer, "w13_perm", None), getattr(layer, "w2_perm", None)
        return layer.kernels.fused_moe_wna16(
            hidden, q13, q2, topk_weights, topk_ids, s13, s2, z13, z2, self.bits, p13, p2
        )


def quantize_wna16_experts(
    weight: torch.Tensor, bits: int, group_size: int, symmetric: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Stacked experts ``[E, N, K]`` -> ``fused_moe_wna16``'s (packed int32
    ``[E, N, K * bits / 32]``, float32 scales ``[E, N, G]``, uint8 zero points or None when
    ``symmetric``) by min-max round-to-nearest in groups of ``group_size`` (-1: the row): for
    tests and benchmarks (checkpoints bring their own)."""
    e, n, k = weight.shape
    group = k if group_size == -1 else group_size
    maxq = (1 << bits) - 1
    w = weight.float().reshape(e, n, k // group, group)
    if symmetric:
        scale = (w.abs().amax(-1) * 2 / maxq).clamp(min=1e-8)
        zero = torch.full_like(scale, float(1 << (bits - 1)))
    else:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scale = ((hi - lo) / maxq).clamp(min=1e-8)
        zero = torch.round(-lo / scale).clamp(0, maxq)
    q = (torch.round(w / scale[..., None]) + zero[..., None]).clamp(0, maxq)
    packed = pack_int32(q.reshape(e, n, k).to(torch.uint8), bits, dim=2)
    zeros = None if symmetric else zero.to(torch.uint8)
    return packed, scale, zeros


def wna16_moe_method(
    config: Any, layer: Any, prefix: str, fmt: WNA16LinearMethod
) -> WNA16MoEMethod:
    """A ``WNA16MoEMethod`` over the dense format ``fmt`` for the quantization ``config``
    (gptq, awq, compressed-tensors) of the MoE layer ``prefix``; the first one of a config logs
    how its experts run.

    Refused on a non-CPU platform whose ``fused_moe_wna16`` is the torch reference (no plugin
    overrides it there: ``kernels.is_reference``), which would dequantize every routed expert
    on every call. engine-triton registers it for CUDA and ROCm, so this refusal only meets a
    GPU platform without that plugin (or a vendor plugin that lacks the op)."""
    kernels = getattr(layer, "kernels", None)
    platform = getattr(kernels, "platform", None)
    if kernels is not None and platform != "cpu" and kernels.is_reference("fused_moe_wna16"):
        raise QuantizationError(
            f"{prefix}: no plugin provides fused_moe_wna16 on {platform}: only the torch "
            "reference does, which dequantizes every routed expert on every call (install "
            "engine-triton, which provides it for CUDA and ROCm, or a vendor plugin that "
            "registers it)"
        )
    method = WNA16MoEMethod(fmt)
    if not getattr(config, "_moe_logged", False):
        config._moe_logged = True
        where = "fused_moe_wna16"
        if kernels is not None:
            where = f"{kernels.provider('fused_moe_wna16')}'s fused_moe_wna16"
            if kernels.is_reference("fused_moe_wna16"):
                where += ", which dequantizes each routed expert per call (slow)"
        logger.info(
            "%s: MoE experts are %s, multiplied weight-only by %s",
            getattr(config, "name", "wna16"),
            method.name,
            where,
        )
    return method
