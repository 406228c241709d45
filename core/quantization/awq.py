"""AWQ checkpoints (AutoAWQ's GEMM format): 4-bit weights with zero points in groups.

The format (config.json ``quantization_config``: ``quant_method: awq``, ``bits`` (4),
``group_size``, ``zero_point`` (true), ``version: gemm``, ``modules_to_not_convert``) stores per
linear layer:

* ``qweight`` int32 ``[K, N / 8]``: eight output features per int32, in AutoAWQ's interleaved
  order (nibble ``i`` holds feature ``[0, 2, 4, 6, 1, 3, 5, 7][i]`` of its group of eight);
* ``qzeros`` int32 ``[K / group, N / 8]``: the zero points, packed the same way;
* ``scales`` float16 ``[K / group, N]``.

Dequantized: ``W[n, k] = (q[k, n] - z[k // group, n]) * s[k // group, n]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from engine.layers.linear import LinearMethod, ShardLayout
from engine.quantization.base import QuantizationConfig, QuantizationError, config_value, require
from engine.quantization.utils import add_param, fill_random_bits, pack_awq, unpack_awq
from engine.quantization.wna16 import WNA16LinearMethod

if TYPE_CHECKING:
    from engine.layers.linear import LinearBase

AWQ_GROUP_SIZES = (32, 64, 128, -1)


class AWQLinearMethod(WNA16LinearMethod):
    """One AWQ GEMM layer (see the module docstring)."""

    checkpoint_params = ("qweight", "qzeros", "scales")

    def __init__(self, group_size: int) -> None:
        super().__init__(4, group_size)
        self.name = f"awq 4-bit g{group_size}"

    def create_weights(self, layer: LinearBase) -> None:
        self.check_sizes(layer)
        for size in layer.output_slices:
            if size % 8:
                raise ValueError(f"{layer.prefix}: AWQ packs 8 output features per int32")
        k, n = layer.input_size_per_partition, layer.output_size_per_partition
        gdim = self.group_input_dim(layer, 0)
        gpack = 1 if self.group_size == -1 else self.group_size
        groups = self.groups(layer)
        add_param(layer, "qweight", (k, n // 8), torch.int32, ShardLayout(1, 0, output_pack=8))
        add_param(
            layer,
            "qzeros",
            (groups, n // 8),
            torch.int32,
            ShardLayout(output_dim=1, output_pack=8, input_dim=gdim, input_pack=gpack),
        )
        add_param(
            layer,
            "scales",
            (groups, n),
            torch.float32,
            ShardLayout(output_dim=1, input_dim=gdim, input_pack=gpack),
        )

    tensor_names = {"qweight": "qweight", "scales": "scales", "zeros": "qzeros"}

    def canonical_tensor(self, role: str, tensor: torch.Tensor) -> torch.Tensor:
        if role in ("qweight", "zeros"):
            return unpack_awq(tensor).t()  # [K or G, N / 8] -> [N, K or G]
        return tensor.t()  # scales [G, N]

    def canonical(self, layer: LinearBase):
        return (
            self.canonical_tensor("qweight", layer.qweight.data),
            self.canonical_tensor("scales", layer.scales.data),
            self.canonical_tensor("zeros", layer.qzeros.data),
            None,
        )

    def dummy_value(self, layer, name, param, generator):
        if name == "qweight":
            fill_random_bits(param, generator)
            return param.data
        if name == "qzeros":
            middle = torch.full((param.shape[0], param.shape[1] * 8), 8, dtype=torch.uint8)
            return pack_awq(middle.to(param.device))
        if name == "scales":
            return torch.full_like(param.data, self.dummy_scale)
        return None


class AWQConfig(QuantizationConfig):
    """AWQ GEMM checkpoints: 4-bit, zero points, group size 32/64/128/-1."""

    name: ClassVar[str] = "awq"
    checkpoint_formats: ClassVar[tuple[str, ...]] = ("awq",)
    description: ClassVar[str] = "AWQ W4A16 (GEMM packing, zero points, group 32/64/128/-1)"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16", "float32")
    kernel_names: ClassVar[tuple[str, ...]] = ("wna16_linear",)

    def __init__(self, group_size: int, modules_to_not_convert: list[str] | None = None) -> None:
        super().__init__()
        self.group_size = group_size
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> AWQConfig:
        bits = int(config_value(config, "bits", "w_bit", default=4))
        group = int(config_value(config, "group_size", "q_group_size", default=128))
        version = str(config.get("version", "gemm")).lower()
        require(bits, (4,), "bits", "AWQ")
        require(group, AWQ_GROUP_SIZES, "group_size", "AWQ")
        require(version, ("gemm",), "version", "AWQ", "GEMV and other AWQ packings are not read")
        require(bool(config.get("zero_point", True)), (True,), "zero_point", "AWQ")
        return cls(group, config.get("modules_to_not_convert"))

    def describe(self) -> str:
        return f"awq 4-bit, group {self.group_size}, zero points"

    def get_linear_method(self, layer: LinearBase, prefix: str) -> LinearMethod | None:
        names = self.checkpoint_names(prefix)
        # AutoAWQ's rule: a module is left unquantized when any listed name is part of its name.
        skip = (any(m in n for m in self.modules_to_not_convert) for n in names)
        if self.all_or_none(prefix, skip):
            return None
        return AWQLinearMethod(self.group_size)

    def get_moe_method(self, layer: Any, prefix: str) -> Any:
        """Integer experts (``engine.quantization.wna16_moe``, weight-only); None (unquantized
        experts) when ``modules_to_not_convert`` names them (AutoAWQ's substring rule, on the
        first expert's gate projection)."""
        from engine.layers.fused_moe import expert_projections
        from engine.quantization.wna16_moe import wna16_moe_method

        base = self.checkpoint_names(prefix)[0]
        for projections in expert_projections(layer):
            skipped = [
                any(m in f"{base}.0.{p}" for m in self.modules_to_not_convert) for p in projections
            ]
            if any(skipped) and not all(skipped):
                kept = [p for p, s in zip(projections, skipped, strict=True) if not s]
                raise QuantizationError(
                    f"{prefix}: AWQ's modules_to_not_convert {self.modules_to_not_convert} "
                    f"leaves some expert projections unquantized but not {', '.join(kept)}; "
                    "experts must be quantized whole or not at all"
                )
            if all(skipped):
                return None
        return wna16_moe_method(self, layer, prefix, AWQLinearMethod(self.group_size))
