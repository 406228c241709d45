"""Gated activations: ``silu(gate) * up`` and ``gelu_tanh(gate) * up`` over ``x = [gate | up]``.

Grid: (rows, column blocks). Arithmetic in float32, one rounding to the output dtype.

``silu_and_mul_quant_fp8`` writes ``silu(gate) * up`` as e4m3 with a per-token scale for an
FP8 linear (the down projection). The scale needs the whole row's absolute maximum before the
first value can be quantized, so one program owns one row and walks it twice in 4096-wide
chunks: pass one computes each value, rounds it to the input dtype (what ``silu_and_mul``
would store) and keeps the running maximum; pass two computes the same values again and
writes them quantized. Recomputing costs a second read of the row's gate/up (from L2 for the
batch sizes that take this path: 256 rows of Llama-3.1-8B's 14,336-wide gate/up are 15 MB)
instead of a bf16 round trip through memory and a second launch, and keeps registers at
``BLOCK`` values per operand whatever the width (a whole 14,336-wide row in registers would
need 16,384-wide blocks). 16 warps, 8 values per thread and operand: 256 rows are only 256
programs, about two per SM on an H100, so each keeps many loads in flight (untuned:
``quant_benchmark --producers`` times the alternatives). The per-element arithmetic is ``_act_and_mul_kernel``'s, so the
result is bit-identical to ``silu_and_mul`` followed by ``quantize_fp8``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.quantized import FP8_MAX, FP8_MIN_SCALE
from engine_triton.kernels.pdl import pdl_launch, pdl_wait

# Columns per chunk of the quantizing kernel (one row per program) and its warps: 8 values per
# thread per operand.
_QUANT_BLOCK = 4096
_QUANT_WARPS = 16


@triton.jit
def _tanh(x):
    # tanh through exp, which both the GPU and the interpreter have: 1 - 2 / (exp(2x) + 1).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _act_and_mul_kernel(
    x_ptr,
    out_ptr,
    x_stride,
    out_stride,
    inter,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:  # SiLU
        act = gate / (1.0 + tl.exp(-gate))
    else:  # GELU, tanh approximation
        act = (
            0.5 * gate * (1.0 + _tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)))
        )
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_chunk(x_row, cols, inter, OUT_DTYPE: tl.constexpr):
    """``silu(gate) * up`` of columns ``cols`` as ``_act_and_mul_kernel`` computes it, rounded
    to ``OUT_DTYPE`` and widened back to float32 (0 where ``cols >= inter``)."""
    mask = cols < inter
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate))
    return (act * up).to(OUT_DTYPE).to(tl.float32)


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    x_stride,
    q_stride,
    inter,
    BLOCK: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    q_row = q_ptr + row * q_stride
    offs = tl.arange(0, BLOCK)
    out_dtype = x_ptr.dtype.element_ty
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, inter, BLOCK):
        y = _silu_mul_chunk(x_row, c0 + offs, inter, out_dtype)
        amax = tl.maximum(amax, tl.abs(y))
    scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), FP8_MAX_C), MIN_SCALE)
    tl.store(s_ptr + row, scale)
    for c0 in range(0, inter, BLOCK):
        cols = c0 + offs
        y = _silu_mul_chunk(x_row, cols, inter, out_dtype)
        q = tl.minimum(tl.maximum(tl.div_rn(y, scale), -FP8_MAX_C), FP8_MAX_C)
        tl.store(q_row + cols, q.to(tl.float8e4nv), mask=cols < inter)


def _launch(x: torch.Tensor, act: int) -> torch.Tensor:
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(inter), 1024)
    if rows:
        _act_and_mul_kernel[(rows, triton.cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), inter, ACT=act, BLOCK=block, num_warps=4,
            **pdl_launch(x.device),
        )  # fmt: skip
    return out.view(*x.shape[:-1], inter)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] (gate then up) -> silu(gate) * up: [..., I]."""
    return _launch(x, 0)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] (gate then up) -> gelu_tanh(gate) * up: [..., I]."""
    return _launch(x, 1)


def silu_and_mul_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., 2I] -> ``silu(gate) * up`` as e4m3 per token: ``(q [..., I], float32 scales
    [M, 1])``, bit-identical to ``quantize_fp8(silu_and_mul(x))``."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    q = torch.empty((rows, inter), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(inter), _QUANT_BLOCK)
    if rows:
        _silu_and_mul_quant_kernel[(rows,)](
            x2, q, scales, x2.stride(0), q.stride(0), inter, BLOCK=block, FP8_MAX_C=FP8_MAX,
            MIN_SCALE=FP8_MIN_SCALE, num_warps=min(_QUANT_WARPS, max(block // 256, 1)),
            **pdl_launch(x.device),
        )  # fmt: skip
    return q.view(*x.shape[:-1], inter), scales
