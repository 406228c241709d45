"""MXFP4 checkpoints (``quant_method: "mxfp4"``: GPT-OSS as OpenAI released it).

MXFP4 (the OCP microscaling format) stores a weight as 4-bit E2M1 values, two per byte (the
low nibble first), in blocks of 32 along the input dim, each block with one power-of-two scale
byte (E8M0: ``2 ** (byte - 127)``). GPT-OSS's checkpoints hold only the experts' weights this
way (``mlp.experts.gate_up_proj_blocks`` ``[E, N, K / 32, 16]`` uint8 and ``..._scales``
``[E, N, K / 32]`` uint8); attention, the router, the embeddings and the head are bf16.

No platform has an MXFP4 expert kernel here yet, so this method **dequantizes the experts at
load** into the model dtype (``dequantize_mxfp4``, called by the GPT-OSS loader) and runs them
as unquantized experts, which then take about four times the memory they take in the file
(bf16). ``bind`` says so in the log, as a warning on an accelerator. Every other
layer is unquantized in the checkpoint and stays so.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from engine.quantization.base import QuantizationConfig, QuantizationError, QuantizationSpec

logger = logging.getLogger(__name__)

#: The 16 E2M1 values, by their 4-bit code (bit 3 is the sign).
E2M1_VALUES = tuple(sign * m for sign in (1.0, -1.0) for m in (0, 0.5, 1, 1.5, 2, 3, 4, 6))
MXFP4_BLOCK = 32
_SCALE_BIAS = 127


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """MXFP4 ``blocks`` ``[..., G, 16]`` (uint8, two E2M1 codes a byte, low nibble first) and
    ``scales`` ``[..., G]`` (uint8 E8M0) -> ``[..., G * 32]`` in ``dtype``: value ``v`` of
    block ``g`` is ``E2M1_VALUES[code] * 2 ** (scales[..., g] - 127)``, exact in bfloat16 and
    float32 for the scales real checkpoints hold."""
    shape = mxfp4_dequantized_shape(blocks.shape, scales.shape)
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise QuantizationError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    # Every byte's two values (low nibble first), so that one lookup decodes a byte.
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.arange(256, device=blocks.device)
    pairs = torch.stack((values[codes & 0x0F], values[codes >> 4]), dim=-1)  # [256, 2]
    groups = blocks.shape[-2]
    flat_blocks = blocks.reshape(-1, groups, MXFP4_BLOCK // 2)
    exponents = scales.reshape(-1, groups).to(torch.int32) - _SCALE_BIAS
    out = torch.empty((flat_blocks.shape[0], groups * MXFP4_BLOCK), dtype=dtype,
                      device=blocks.device)  # fmt: skip
    # In float32 (exact: a power of two times a value of two significant bits), a chunk of
    # rows at a time so that the float32 temporary stays near 64 MiB.
    chunk = max(1, (1 << 24) // (groups * MXFP4_BLOCK))
    for start in range(0, flat_blocks.shape[0], chunk):
        part = pairs[flat_blocks[start : start + chunk].long()].view(-1, groups, MXFP4_BLOCK)
        part = torch.ldexp(part, exponents[start : start + chunk, :, None])
        out[start : start + chunk] = part.flatten(1).to(dtype)
    return out.view(shape)


def mxfp4_dequantized_shape(blocks: Sequence[int], scales: Sequence[int]) -> tuple[int, ...]:
    """The shape ``dequantize_mxfp4`` returns for blocks and scales of these shapes; raises
    ``QuantizationError`` when they do not pair (the loader's dry run checks this)."""
    blocks, scales = tuple(blocks), tuple(scales)
    if blocks[:-1] != scales or not blocks or blocks[-1] != MXFP4_BLOCK // 2:
        raise QuantizationError(
            f"MXFP4 blocks {blocks} do not match scales {scales} "
            f"(expected blocks [..., G, {MXFP4_BLOCK // 2}] and scales [..., G])"
        )
    return (*blocks[:-2], blocks[-2] * MXFP4_BLOCK)


class Mxfp4Config(QuantizationConfig):
    """MXFP4 expert weights (GPT-OSS), dequantized at load; see the module docstring."""

    name: ClassVar[str] = "mxfp4"
    checkpoint_formats: ClassVar[tuple[str, ...]] = ("mxfp4",)
    description: ClassVar[str] = (
        "MXFP4 expert weights (GPT-OSS checkpoints), dequantized at load to the model dtype: "
        "no MXFP4 kernel yet"
    )
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")

    def __init__(self, modules_to_not_convert: list[str] | None = None) -> None:
        super().__init__()
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Mxfp4Config:
        return cls(config.get("modules_to_not_convert"))

    def bind(self, spec: QuantizationSpec) -> None:
        level = logging.INFO if spec.is_cpu else logging.WARNING
        logger.log(
            level,
            "mxfp4: the experts' MXFP4 weights are dequantized at load to %s (about 4x their "
            "size in the file): no platform has an MXFP4 expert kernel yet",
            spec.dtype or "the model dtype",
        )

    def describe(self) -> str:
        return "mxfp4 (experts dequantized at load)"

    def get_linear_method(self, layer: Any, prefix: str) -> None:
        """Every linear layer of an MXFP4 checkpoint is unquantized (only experts are MXFP4)."""
        return None

    def get_moe_method(self, layer: Any, prefix: str) -> None:
        """Unquantized experts: the model's loader dequantizes the MXFP4 blocks into them."""
        return None
