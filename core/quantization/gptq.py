"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum): 4- or 8-bit weights in groups, symmetric
or with zero points, optionally act-order (``desc_act`` with ``g_idx``).

The format (config.json ``quantization_config``: ``quant_method: gptq``, ``bits``,
``group_size``, ``desc_act``, ``sym``, ``checkpoint_format``) stores per linear layer, with
``p = 32 / bits`` values per int32, lowest bits first:

* ``qweight`` int32 ``[K / p, N]``: packed along the input features;
* ``qzeros`` int32 ``[K / group, N / p]``: zero points packed along the output features; in
  the original ``gptq`` (v1) checkpoint format each is stored minus one (``gptq_v2``: as is);
* ``scales`` float16 ``[K / group, N]``;
* ``g_idx`` int32 ``[K]``: the group of every input feature (act-order shuffles them; without
  ``desc_act`` it is ``k // group`` and ignored).

Dequantized: ``W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from engine.layers.linear import LinearMethod, ShardLayout
from engine.layers.weight_utils import ModelLoadError
from engine.quantization.base import (
    QuantizationConfig,
    QuantizationError,
    config_value,
    require,
)
from engine.quantization.utils import add_param, fill_random_bits, unpack_int32
from engine.quantization.wna16 import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, WNA16LinearMethod

if TYPE_CHECKING:
    from engine.layers.linear import LinearBase


class GPTQLinearMethod(WNA16LinearMethod):
    """One GPTQ layer (see the module docstring)."""

    checkpoint_params = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(
        self, bits: int, group_size: int, *, act_order: bool, v1_zeros: bool, sym: bool
    ) -> None:
        super().__init__(bits, group_size, act_order=act_order)
        self.v1_zeros = v1_zeros
        self.sym = sym
        self.name = f"gptq {bits}-bit g{group_size}{' act-order' if act_order else ''}"

    def create_weights(self, layer: LinearBase) -> None:
        self.check_sizes(layer)
        k, n, p = layer.input_size_per_partition, layer.output_size_per_partition, self.pack
        group = self.group_size
        add_param(layer, "qweight", (k // p, n), torch.int32, ShardLayout(1, 0, input_pack=p))
        g_idx = add_param(
            layer, "g_idx", (k,), torch.int32, ShardLayout(None, 0), _shared_g_idx_loader(layer)
        )
        # Without act-order g_idx is k // group: a checkpoint may leave it out.
        g_idx.optional = not self.act_order
        gdim = self.group_input_dim(layer, 0)
        groups = (
            self.groups(layer) if gdim is not None or group == -1 else layer.input_size // group
        )
        gpack = 1 if group == -1 else group
        add_param(
            layer,
            "qzeros",
            (groups, n // p),
            torch.int32,
            ShardLayout(output_dim=1, output_pack=p, input_dim=gdim, input_pack=gpack),
        )
        add_param(
            layer,
            "scales",
            (groups, n),
            torch.float32,
            ShardLayout(output_dim=1, input_dim=gdim, input_pack=gpack),
        )

    tensor_names = {"qweight": "qweight", "scales": "scales", "zeros": "qzeros"}
    extra_tensor_names = ("g_idx",)
    g_idx_name = "g_idx"

    def canonical_tensor(self, role: str, tensor: torch.Tensor) -> torch.Tensor:
        if role == "qweight":
            return unpack_int32(tensor, self.bits, dim=0).t()  # [K / p, N] -> [N, K]
        if role == "zeros":
            zeros = unpack_int32(tensor, self.bits, dim=1)  # [G, N / p] -> [G, N]
            if self.v1_zeros:
                zeros = zeros + 1  # stored minus one; 2**bits itself is a legal v1 zero point
            return zeros.t()
        return tensor.t()  # scales [G, N]

    def canonical(self, layer: LinearBase):
        g_idx = layer.g_idx.data if self.act_order else None
        return (
            self.canonical_tensor("qweight", layer.qweight.data),
            self.canonical_tensor("scales", layer.scales.data),
            self.canonical_tensor("zeros", layer.qzeros.data),
            g_idx,
        )

    def dummy_value(self, layer, name, param, generator):
        if name == "qweight":
            fill_random_bits(param, generator)
            return param.data
        if name == "qzeros":
            middle = 1 << (self.bits - 1)  # stored minus one in the v1 format
            return torch.full_like(param.data, self.packed_word(middle - int(self.v1_zeros)))
        if name == "scales":
            return torch.full_like(param.data, self.dummy_scale)
        if name == "g_idx":
            group = layer.input_size_per_partition if self.group_size == -1 else self.group_size
            return torch.arange(param.numel(), device=param.device, dtype=torch.int32) // group
        return None


def _shared_g_idx_loader(layer: LinearBase) -> Any:
    """Fused slices read the same input, so act-order gave them the same ``g_idx`` (GPTQ sorts
    by the input's Hessian): load the first, refuse a slice whose ``g_idx`` differs."""
    seen: list[torch.Tensor] = []

    def load(param: torch.nn.Parameter, loaded: Any, shard_id: object | None = None) -> None:
        if shard_id is None or param.device.type == "meta":
            layer.weight_loader(param, loaded, shard_id)
            return
        before = param.data.clone() if seen else None
        layer.weight_loader(param, loaded, shard_id)
        if before is not None and not torch.equal(before, param.data):
            raise ModelLoadError(
                f"{layer.prefix}: the fused modules have different act-order g_idx; one "
                "fused layer needs one input order"
            )
        seen.append(param.data)

    return load


class GPTQConfig(QuantizationConfig):
    """GPTQ checkpoints: 4/8-bit, group size 32/64/128/-1, act-order, sym or with zeros."""

    name: ClassVar[str] = "gptq"
    checkpoint_formats: ClassVar[tuple[str, ...]] = ("gptq",)
    description: ClassVar[str] = (
        "GPTQ W4A16/W8A16 (group 32/64/128/-1, act-order, sym/asym), weight-only"
    )
    supported_dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16", "float32")
    kernel_names: ClassVar[tuple[str, ...]] = ("wna16_linear",)

    def __init__(
        self,
        bits: int,
        group_size: int,
        desc_act: bool,
        sym: bool,
        v1_zeros: bool,
        dynamic: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__()
        self.bits, self.group_size, self.desc_act, self.sym = bits, group_size, desc_act, sym
        self.v1_zeros = v1_zeros
        self.dynamic = dict(dynamic or {})

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> GPTQConfig:
        bits = int(config_value(config, "bits", "w_bit", default=4))
        group = int(config_value(config, "group_size", "q_group_size", default=128))
        desc_act = bool(config.get("desc_act", False))
        sym = bool(config.get("sym", True))
        fmt = config.get("checkpoint_format", "gptq")
        if config.get("lm_head"):
            raise QuantizationError(
                "GPTQ checkpoint quantizes the LM head (lm_head: true), which is not supported "
                "(supported: an unquantized lm_head)"
            )
        require(fmt, ("gptq", "gptq_v2"), "checkpoint_format", "GPTQ")
        dynamic = config.get("dynamic") or {}
        for overrides in dynamic.values():
            if isinstance(overrides, Mapping):
                cls._check(
                    int(overrides.get("bits", bits)), int(overrides.get("group_size", group))
                )
        cls._check(bits, group)
        return cls(bits, group, desc_act, sym, fmt == "gptq", dynamic)

    @staticmethod
    def _check(bits: int, group: int) -> None:
        require(bits, SUPPORTED_BITS, "bits", "GPTQ")
        require(group, SUPPORTED_GROUP_SIZES, "group_size", "GPTQ", "-1 means one group per row")

    def describe(self) -> str:
        parts = [f"gptq {self.bits}-bit", f"group {self.group_size}"]
        parts.append("act-order" if self.desc_act else "in order")
        parts.append("sym" if self.sym else "asym")
        return ", ".join(parts)

    def _module_overrides(self, name: str) -> dict[str, Any] | None:
        """GPTQModel's per-module ``dynamic`` overrides for checkpoint module ``name``: None
        when a ``-:`` rule excludes it, else the overrides (possibly empty)."""
        for pattern, overrides in self.dynamic.items():
            negative = pattern.startswith("-:")
            regex = pattern[2:] if pattern[:2] in ("-:", "+:") else pattern
            if re.match(regex, name):
                return None if negative else dict(overrides or {})
        return {}

    def get_linear_method(self, layer: LinearBase, prefix: str) -> LinearMethod | None:
        names = self.checkpoint_names(prefix)
        overrides = [self._module_overrides(n) for n in names]
        if self.all_or_none(prefix, (o is None for o in overrides)):
            return None
        if any(o != overrides[0] for o in overrides):
            raise QuantizationError(
                f"{prefix}: the GPTQ 'dynamic' settings differ between the fused modules "
                f"{', '.join(names)}; a fused layer needs one setting"
            )
        return self._method(overrides[0] or {})

    def _method(self, o: Mapping[str, Any]) -> GPTQLinearMethod:
        """The format of a module with ``dynamic`` overrides ``o`` (empty: the config's)."""
        return GPTQLinearMethod(
            int(o.get("bits", self.bits)),
            int(o.get("group_size", self.group_size)),
            act_order=bool(o.get("desc_act", self.desc_act)),
            v1_zeros=self.v1_zeros,
            sym=bool(o.get("sym", self.sym)),
        )

    def get_moe_method(self, layer: Any, prefix: str) -> Any:
        """Integer experts (``engine.quantization.wna16_moe``, weight-only, act-order
        included) with the settings of the first expert's projections (a ``dynamic`` override
        of them included: the same for all three); None (unquantized experts) when a ``-:``
        rule excludes them."""
        from engine.layers.fused_moe import expert_projections
        from engine.quantization.wna16_moe import wna16_moe_method

        base = self.checkpoint_names(prefix)[0]
        o = None
        for projections in expert_projections(layer):
            rules = [self._module_overrides(f"{base}.0.{p}") for p in projections]
            if any(r != rules[0] for r in rules):
                raise QuantizationError(
                    f"{prefix}: the GPTQ 'dynamic' settings differ between the experts' "
                    f"projections ({', '.join(projections)}); quantized experts need one "
                    "setting for all three"
                )
            if rules[0] != {}:
                o = rules[0]
                break
        else:
            o = {}
        if o is None:
            return None
        self._check(int(o.get("bits", self.bits)), int(o.get("group_size", self.group_size)))
        return wna16_moe_method(self, layer, prefix, self._method(o))
