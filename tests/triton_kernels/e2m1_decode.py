"""A tiny Triton kernel around engine-triton's in-register MXFP4 decode
(``engine_triton.kernels.fused_moe._e2m1_to_f32``), so that tests can hold it to
``engine.kernels.quantized.dequantize_mxfp4_experts`` bit for bit: under the interpreter
(``test_triton_fused_moe_mxfp4.py``) and on a GPU (``tests/gpu/test_fused_moe_gpu.py``). It
imports Triton: import it inside a test."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_triton.kernels.fused_moe import _e2m1_to_f32


@triton.jit
def _decode_kernel(b_ptr, s_ptr, out_ptr, N: tl.constexpr):
    c = tl.arange(0, N)
    b = tl.load(b_ptr + c).to(tl.int32)
    s = tl.load(s_ptr + c // 16).to(tl.int32)
    tl.store(out_ptr + 2 * c, _e2m1_to_f32(b & 15, s))  # the low nibble: the even value
    tl.store(out_ptr + 2 * c + 1, _e2m1_to_f32(b >> 4, s))


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 ``blocks`` ``[N]`` (N a power of two, whole blocks of 16 bytes) and their uint8
    E8M0 exponents ``[N / 16]`` -> the ``2 N`` float32 values, decoded by the kernels' helper."""
    out = torch.empty(2 * blocks.numel(), dtype=torch.float32, device=blocks.device)
    _decode_kernel[(1,)](blocks, scales, out, N=blocks.numel())
    return out


# Exponents across the range the decode is exact for (2 to 252); checkpoints hold about 110-130.
EXPONENTS = (2, 64, 100, 118, 127, 130, 200, 252)


def every_byte_at_every_exponent() -> tuple[torch.Tensor, torch.Tensor]:
    """All 256 byte values at each of ``EXPONENTS``: (uint8 bytes ``[256 * 8]``, uint8
    exponents ``[16 * 8]``, one per block of 16 bytes)."""
    blocks = torch.arange(256, dtype=torch.uint8).repeat(len(EXPONENTS))
    scales = torch.tensor(EXPONENTS, dtype=torch.uint8).repeat_interleave(16)
    return blocks, scales
