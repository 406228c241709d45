"""Checkpoints saved by the ``compressed-tensors`` library (llm-compressor's format).

config.json's ``quantization_config`` (``quant_method: compressed-tensors``) lists
``config_groups``, each a scheme (``weights`` / ``input_activations`` quantization args) for the
modules it ``targets`` (``"Linear"``, or ``re:`` regexes of module names), minus ``ignore``.
Each scheme maps to one of the engine's linear methods:

=================================================  ==============================  ==============
scheme (weights; input activations)                 format                          method
=================================================  ==============================  ==============
FP8, tensor or channel; FP8 token dynamic or        ``float-quantized``             ``Fp8LinearMethod``
tensor static, or none (weight-only)
FP8, 2-D block ``[bn, bk]``; FP8 group dynamic      ``float-quantized``             ``Fp8BlockLinearMethod``
(group ``bk``)
INT8, channel or tensor, symmetric; INT8 token      ``int-quantized``               ``Int8LinearMethod``
dynamic symmetric, or tensor static (with zero
point when asymmetric)
INT4/INT8, group (32/64/128) or channel, sym or     ``pack-quantized``              ``CTWNA16LinearMethod``
asym, act-order groups; none
=================================================  ==============================  ==============

Anything else (NVFP4, MXFP4, 2:4 sparsity, W4A8, ...) is refused at load with this list.

The pack-quantized tensors: ``weight_packed`` int32 ``[N, K * bits / 32]`` (the values plus
``2**(bits-1)``, lowest bits first), ``weight_scale`` ``[N, K / group]``, for asymmetric
schemes ``weight_zero_point`` packed along the *output* features ``[N * bits / 32, K / group]``,
``weight_shape`` (the unpacked ``[N, K]``) and, with act-order, ``weight_g_idx`` ``[K]``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from engine.layers.linear import LinearMethod, ShardLayout
from engine.layers.weight_utils import ModelLoadError, materialize
from engine.quantization.base import (
    QuantizationConfig,
    QuantizationError,
    QuantizationSpec,
    matches_module,
)
from engine.quantization.fp8 import (
    Fp8BlockLinearMethod,
    Fp8LinearMethod,
    fp8_device_reasons,
    fp8_w8a8_reasons,
)
from engine.quantization.int8 import Int8LinearMethod
from engine.quantization.utils import add_param, fill_random_bits, pack_int32, unpack_int32
from engine.quantization.wna16 import SUPPORTED_GROUP_SIZES, WNA16LinearMethod

if TYPE_CHECKING:
    from engine.layers.linear import LinearBase

logger = logging.getLogger(__name__)

SUPPORTED_SCHEMES = (
    "FP8 W8A8 (float-quantized: tensor/channel weights, token-dynamic or tensor-static "
    "activations) and FP8 weight-only; FP8 block [bn, bk] weights with group-dynamic "
    "activations; INT8 W8A8 (int-quantized: channel/tensor weights, token-dynamic or "
    "tensor-static activations); W4A16/W8A16 (pack-quantized: group 32/64/128 or channel, "
    "sym/asym, act-order)"
)


class CTWNA16LinearMethod(WNA16LinearMethod):
    """compressed-tensors ``pack-quantized`` weights (see the module docstring)."""

    def __init__(self, bits: int, group_size: int, *, symmetric: bool, act_order: bool) -> None:
        super().__init__(bits, group_size, act_order=act_order)
        self.symmetric = symmetric
        self.checkpoint_params = (
            ("weight_packed", "weight_scale", "weight_shape")
            + (() if symmetric else ("weight_zero_point",))
            + (("weight_g_idx",) if act_order else ())
        )
        self.name = (
            f"compressed-tensors w{bits}a16 g{group_size}{'' if symmetric else ' asym'}"
            f"{' act-order' if act_order else ''}"
        )
        self.tensor_names = {
            "qweight": "weight_packed",
            "scales": "weight_scale",
            "zeros": None if symmetric else "weight_zero_point",
        }

    extra_tensor_names = ("weight_shape", "weight_g_idx")
    g_idx_name = "weight_g_idx"

    def canonical_tensor(self, role: str, tensor: torch.Tensor) -> torch.Tensor:
        if role == "qweight":
            return unpack_int32(tensor, self.bits, dim=1)  # [N, K / p] -> [N, K]
        if role == "zeros":
            return unpack_int32(tensor, self.bits, dim=0)  # [N / p, G] -> [N, G]
        return tensor  # scales [N, G]

    def create_weights(self, layer: LinearBase) -> None:
        self.check_sizes(layer)
        k, n, p = layer.input_size_per_partition, layer.output_size_per_partition, self.pack
        gdim = self.group_input_dim(layer, 1)
        gpack = 1 if self.group_size == -1 else self.group_size
        groups = (
            self.groups(layer)
            if gdim is not None or self.group_size == -1
            else layer.input_size // self.group_size
        )
        add_param(layer, "weight_packed", (n, k // p), torch.int32, ShardLayout(0, 1, input_pack=p))
        add_param(
            layer,
            "weight_scale",
            (n, groups),
            torch.float32,
            ShardLayout(output_dim=0, input_dim=gdim, input_pack=gpack),
        )
        add_param(
            layer,
            "weight_shape",
            (len(layer.output_slices), 2),
            torch.int64,
            ShardLayout(output_dim=None, input_dim=None),
            loader=_shape_loader(layer),
        )
        if not self.symmetric:
            for size in layer.output_slices:
                if size % p:
                    raise QuantizationError(
                        f"{layer.prefix}: zero points pack {p} output features per int32, "
                        f"but a slice has {size}"
                    )
            add_param(
                layer,
                "weight_zero_point",
                (n // p, groups),
                torch.int32,
                ShardLayout(output_dim=0, output_pack=p, input_dim=gdim, input_pack=gpack),
            )
        if self.act_order:
            add_param(layer, "weight_g_idx", (k,), torch.int32, ShardLayout(None, 0))

    def canonical(self, layer: LinearBase):
        k = layer.input_size_per_partition
        expected = [[full, layer.input_size] for full in layer.output_full_sizes]
        got = layer.weight_shape.data.reshape(-1, 2).tolist()
        if got != expected:
            raise ModelLoadError(
                f"{layer.prefix}: weight_shape {got} does not match the layer's {expected}"
            )
        q = self.canonical_tensor("qweight", layer.weight_packed.data)[:, :k]
        scales = self.canonical_tensor("scales", layer.weight_scale.data)
        if self.symmetric:
            zeros = torch.full(
                scales.shape, 1 << (self.bits - 1), dtype=torch.uint8, device=scales.device
            )
        else:
            zeros = self.canonical_tensor("zeros", layer.weight_zero_point.data)
        g_idx = layer.weight_g_idx.data if self.act_order else None
        return q, scales, zeros, g_idx

    def dummy_value(self, layer, name, param, generator):
        if name == "weight_packed":
            fill_random_bits(param, generator)
            return param.data
        if name == "weight_scale":
            return torch.full_like(param.data, self.dummy_scale)
        if name == "weight_zero_point":
            middle = torch.full(
                (param.shape[0] * self.pack, param.shape[1]),
                1 << (self.bits - 1),
                dtype=torch.uint8,
                device=param.device,
            )
            return pack_int32(middle, self.bits, dim=0)
        if name == "weight_shape":
            shapes = [[full, layer.input_size] for full in layer.output_full_sizes]
            return torch.tensor(shapes, dtype=torch.int64, device=param.device)
        if name == "weight_g_idx":
            group = layer.input_size_per_partition if self.group_size == -1 else self.group_size
            return torch.arange(param.numel(), device=param.device, dtype=torch.int32) // group
        return None


def _shape_loader(layer: LinearBase) -> Any:
    """``weight_shape`` (the unpacked ``[N, K]`` of one checkpoint module) into row ``i`` of
    the layer's ``[num_slices, 2]`` record, checked after loading."""

    def load(param: torch.nn.Parameter, loaded: Any, shard_id: object | None = None) -> None:
        index = 0 if shard_id is None else layer._slice_index(shard_id)
        if tuple(loaded.shape) != (2,):
            raise ModelLoadError(f"{layer.prefix}: weight_shape has shape {tuple(loaded.shape)}")
        param.data[index].copy_(materialize(loaded))

    return load


class _Scheme:
    """One config group's scheme, normalised, and the method it maps to."""

    def __init__(self, group: str, scheme: Mapping[str, Any], fmt: str | None) -> None:
        self.group = group
        self.targets = list(scheme.get("targets") or [])
        self.weights = dict(scheme.get("weights") or {})
        self.inputs = dict(scheme.get("input_activations") or {}) or None
        self.format = scheme.get("format") or fmt
        if scheme.get("output_activations"):
            self.refuse("output activation quantization")
        self.kind = self._classify()

    def refuse(self, what: str) -> None:
        raise QuantizationError(
            f"compressed-tensors config group {self.group!r} uses {what}, which is not "
            f"supported. Supported schemes: {SUPPORTED_SCHEMES}"
        )

    def _classify(self) -> str:
        w, a = self.weights, self.inputs
        if not w:
            self.refuse("no weight quantization")
        wtype, bits, strategy = w.get("type"), int(w.get("num_bits", 0)), w.get("strategy")
        if wtype == "float" and bits == 8:
            if strategy == "block":
                block = w.get("block_structure") or []
                if len(block) != 2:
                    self.refuse(f"FP8 block structure {block!r}")
                if not (
                    a
                    and a.get("type") == "float"
                    and int(a.get("num_bits", 0)) == 8
                    and a.get("strategy") == "group"
                    and a.get("dynamic")
                    and int(a.get("group_size") or 0) == int(block[1])
                ):
                    self.refuse("FP8 block weights without dynamic per-group FP8 activations")
                return "fp8_block"
            if strategy not in ("tensor", "channel"):
                self.refuse(f"FP8 weights with strategy {strategy!r}")
            if a is not None:
                self._check_float_inputs(a)
            return "fp8"
        if wtype == "int" and bits == 8 and a is not None:
            if strategy not in ("tensor", "channel") or not w.get("symmetric", True):
                self.refuse(f"INT8 weights with strategy {strategy!r} / asymmetric weights")
            if a.get("type") != "int" or int(a.get("num_bits", 0)) != 8:
                self.refuse("INT8 weights with non-INT8 activations")
            dyn, astrat = bool(a.get("dynamic")), a.get("strategy")
            if dyn and (astrat != "token" or not a.get("symmetric", True)):
                self.refuse("dynamic INT8 activations other than symmetric per-token")
            if not dyn and astrat != "tensor":
                self.refuse(f"static INT8 activations with strategy {astrat!r}")
            return "int8"
        if wtype == "int" and bits in (4, 8) and a is None:
            if self.format not in ("pack-quantized", None):
                self.refuse(f"integer weight-only format {self.format!r}")
            if strategy not in ("group", "channel"):
                self.refuse(f"W{bits}A16 weights with strategy {strategy!r}")
            group = int(w.get("group_size") or -1) if strategy == "group" else -1
            if group not in SUPPORTED_GROUP_SIZES:
                self.refuse(f"group size {group}")
            return "wna16"
        self.refuse(f"{bits}-bit {wtype} weights with input activations {a!r}")
        return ""

    def _check_float_inputs(self, a: Mapping[str, Any]) -> None:
        if a.get("type") != "float" or int(a.get("num_bits", 0)) != 8:
            self.refuse("FP8 weights with non-FP8 activations")
        dyn, strat = bool(a.get("dynamic")), a.get("strategy")
        if dyn and strat != "token":
            self.refuse(f"dynamic FP8 activations with strategy {strat!r} (supported: token)")
        if not dyn and strat != "tensor":
            self.refuse(f"static FP8 activations with strategy {strat!r} (supported: tensor)")

    def method(self, activation_quant: bool) -> LinearMethod:
        w, a = self.weights, self.inputs
        if self.kind == "fp8":
            return Fp8LinearMethod(
                serialized=True,
                weight_scheme=w["strategy"],
                static_input=a is not None and not a.get("dynamic"),
                activation_quant=activation_quant and a is not None,
                name="compressed-tensors fp8",
            )
        if self.kind == "fp8_block":
            return Fp8BlockLinearMethod(
                tuple(w["block_structure"]),
                scale_name="weight_scale",
                activation_quant=activation_quant,
                name="compressed-tensors fp8 (block)",
            )
        if self.kind == "int8":
            static = not a.get("dynamic")
            return Int8LinearMethod(
                weight_scheme=w["strategy"],
                static_input=static,
                asymmetric=static and not a.get("symmetric", True),
            )
        group = int(w.get("group_size") or -1) if w.get("strategy") == "group" else -1
        actorder = w.get("actorder")
        return CTWNA16LinearMethod(
            int(w["num_bits"]),
            group,
            symmetric=bool(w.get("symmetric", True)),
            act_order=actorder not in (None, False, "static"),
        )

    def kernels(self) -> tuple[str, ...]:
        return {
            "fp8": ("fp8_linear",),
            "fp8_block": ("fp8_block_linear",),
            "int8": ("int8_linear",),
            "wna16": ("wna16_linear",),
        }[self.kind]

    def matches(self, name: str) -> int:
        """How specifically this group targets module ``name``: 3 by name, 2 by regex, 1 by
        the ``Linear`` class, 0 not at all."""
        best = 0
        for target in self.targets:
            if target.startswith("re:"):
                if matches_module(name, [target]):
                    best = max(best, 2)
            elif target == "Linear":
                best = max(best, 1)
            elif matches_module(name, [target]):
                best = max(best, 3)
        return best


class CompressedTensorsConfig(QuantizationConfig):
    """compressed-tensors checkpoints: FP8 (tensor/channel/block), INT8 W8A8, W4A16/W8A16."""

    name: ClassVar[str] = "compressed-tensors"
    checkpoint_formats: ClassVar[tuple[str, ...]] = ("compressed-tensors",)
    description: ClassVar[str] = (
        "compressed-tensors (llm-compressor) FP8 W8A8/block, INT8 W8A8, W4A16/W8A16 pack-quantized"
    )
    kernel_names: ClassVar[tuple[str, ...]] = (
        "fp8_linear",
        "fp8_block_linear",
        "int8_linear",
        "wna16_linear",
    )

    def __init__(self, schemes: list[_Scheme], ignore: list[str], kv_cache_scheme: Any) -> None:
        super().__init__()
        self.schemes = schemes
        self.ignore = ignore
        self.kv_cache_scheme = kv_cache_scheme
        self.activation_quant = True

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> CompressedTensorsConfig:
        if config.get("sparsity_config"):
            raise QuantizationError(
                "compressed-tensors checkpoint is sparse (sparsity_config), which is not "
                f"supported. Supported schemes: {SUPPORTED_SCHEMES}"
            )
        if config.get("transform_config"):
            raise QuantizationError(
                "compressed-tensors checkpoint uses transforms (transform_config: rotations), "
                "which are not supported"
            )
        groups = config.get("config_groups") or {}
        if not groups:
            raise QuantizationError("compressed-tensors checkpoint has no config_groups")
        fmt = config.get("format")
        schemes = [_Scheme(name, scheme, fmt) for name, scheme in groups.items()]
        kv = config.get("kv_cache_scheme")
        if kv:
            if kv.get("type") != "float" or int(kv.get("num_bits", 0)) != 8:
                raise QuantizationError(
                    f"compressed-tensors kv_cache_scheme {kv!r} is not supported (supported: "
                    "8-bit float, per tensor)"
                )
        return cls(schemes, list(config.get("ignore") or []), kv)

    def check(self, spec: QuantizationSpec) -> list[str]:
        reasons = super().check(spec)
        if any(s.kind in ("fp8", "fp8_block") for s in self.schemes):
            reasons += fp8_device_reasons(spec)
        return reasons

    def used_kernels(self) -> tuple[str, ...]:
        return tuple(sorted({k for s in self.schemes for k in s.kernels()}))

    def bind(self, spec: QuantizationSpec) -> None:
        uses_fp8_acts = any(
            s.kind == "fp8_block" or (s.kind == "fp8" and s.inputs is not None)
            for s in self.schemes
        )
        why = fp8_w8a8_reasons(spec)
        self.activation_quant = not why
        if why and uses_fp8_acts:
            logger.warning(
                "compressed-tensors: %s, so FP8 weights are multiplied weight-only "
                "(activations stay %s)",
                why[0],
                spec.dtype or "in the model dtype",
            )

    def describe(self) -> str:
        kinds = sorted({s.kind for s in self.schemes})
        return f"compressed-tensors ({', '.join(kinds)})"

    def scheme_for(self, name: str) -> _Scheme | None:
        if matches_module(name, self.ignore):
            return None
        ranked = [(s.matches(name), i, s) for i, s in enumerate(self.schemes)]
        ranked = [r for r in ranked if r[0] > 0]
        if not ranked:
            return None
        return max(ranked, key=lambda r: (r[0], -r[1]))[2]

    def get_linear_method(self, layer: LinearBase, prefix: str) -> LinearMethod | None:
        names = self.checkpoint_names(prefix)
        schemes = [self.scheme_for(n) for n in names]
        if self.all_or_none(prefix, (s is None for s in schemes)):
            return None
        if any(s is not schemes[0] for s in schemes):
            raise QuantizationError(
                f"{prefix}: the fused modules {', '.join(names)} use different "
                "compressed-tensors schemes; a fused layer needs one"
            )
        return schemes[0].method(self.activation_quant)

    def get_moe_method(self, layer: Any, prefix: str) -> Any:
        """FP8 experts (``engine.quantization.fp8_moe``, weight-only) for the FP8 schemes:
        tensor or channel weights, and 2-D blocks; integer experts
        (``engine.quantization.wna16_moe``) for pack-quantized W4A16/W8A16;
        None (unquantized experts) when no group targets them. The scheme is the one of the
        first expert's gate projection (Qwen's ``experts.0.gate_proj``, Mixtral's
        ``experts.0.w1``); other schemes are refused."""
        from engine.layers.fused_moe import expert_projections
        from engine.quantization.fp8_moe import fp8_moe_method

        base = self.checkpoint_names(prefix)[0]
        schemes: set[Any] = set()
        for projections in expert_projections(layer):
            found = [self.scheme_for(f"{base}.0.{p}") for p in projections]
            if any(s is not found[0] for s in found):
                raise QuantizationError(
                    f"compressed-tensors: the experts' projections of {prefix} "
                    f"({', '.join(projections)}) fall under different schemes (or some are "
                    "ignored); quantized experts need one scheme for all three"
                )
            schemes.add(found[0])
        schemes.discard(None)
        if not schemes:
            return None
        scheme = schemes.pop()
        if scheme.kind == "fp8":
            return fp8_moe_method(
                self, layer, prefix, serialized=True, weight_scheme=scheme.weights["strategy"]
            )
        if scheme.kind == "fp8_block":
            return fp8_moe_method(
                self,
                layer,
                prefix,
                serialized=True,
                block_size=tuple(scheme.weights["block_structure"]),
                scale_name="weight_scale",
            )
        if scheme.kind == "wna16":
            from engine.quantization.wna16_moe import wna16_moe_method

            return wna16_moe_method(self, layer, prefix, scheme.method(False))
        raise NotImplementedError(
            f"compressed-tensors {scheme.kind} experts ({prefix}) are not supported; quantized "
            "MoE experts are served for FP8 schemes (tensor/channel weights, or blocks) and "
            "W4A16/W8A16 pack-quantized ones, weight-only"
        )
