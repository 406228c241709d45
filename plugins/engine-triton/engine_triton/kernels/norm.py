"""RMSNorm and fused residual-add + RMSNorm as Triton kernels, optionally writing the normed
rows as e4m3 with per-token scales for an FP8 linear (``*_quant_fp8``).

One program normalises one row. Arithmetic is float32 and the result is cast back to the input
dtype, as ``engine.kernels.reference`` specifies; the fused variant rounds the sum to the input
dtype first and normalises that rounded sum, so both outputs match the reference bit-for-bit in
float32 and to rounding in bf16/fp16.

With ``QUANT`` the same program, after the same arithmetic, rounds the normed row to the input
dtype (what ``rms_norm`` would store), takes its absolute maximum and writes the row quantized
as ``quantize_fp8`` (``fp8_linear.py``) would from the stored values: scale
``max(amax / 448, FP8_MIN_SCALE)`` with IEEE division, values ``x / scale`` saturated and
rounded to e4m3. The whole row is in registers already, so the quantization costs no second
read, and the result is bit-identical to ``rms_norm`` followed by ``quantize_fp8``. float32
rows take exactly that pair of launches instead (``_plain_then_quantize`` says why).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.quantized import FP8_MAX, FP8_MIN_SCALE
from engine_triton.kernels.fp8_linear import quantize_fp8
from engine_triton.kernels.pdl import pdl_launch, pdl_wait


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    scale_ptr,
    x_stride,
    x_stride_inner,
    inner,
    res_stride,
    out_stride,
    res_out_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    QUANT: tl.constexpr = False,
    FP8_MAX_C: tl.constexpr = 448.0,
    MIN_SCALE: tl.constexpr = 1.0,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    # Row r of a [..., inner, hidden] input sits at (r // inner, r % inner): per-head norms read
    # a strided [T, heads, head_size] view of the fused qkv output without a copy.
    x_row = (row // inner) * x_stride + (row % inner) * x_stride_inner
    x = tl.load(x_ptr + x_row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        # The reference rounds the sum to the activation dtype before normalising it.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / hidden
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = xf * tl.rsqrt(var + eps) * w
    if QUANT:
        # out_ptr is e4m3: quantize the values rms_norm would have stored (in x's dtype).
        yr = y.to(x.dtype).to(tl.float32)
        amax = tl.max(tl.abs(yr), axis=0)  # masked columns are 0
        scale = tl.maximum(tl.div_rn(amax, FP8_MAX_C), MIN_SCALE)
        tl.store(scale_ptr + row, scale)
        q = tl.minimum(tl.maximum(tl.div_rn(yr, scale), -FP8_MAX_C), FP8_MAX_C)
        tl.store(out_ptr + row * out_stride + cols, q.to(tl.float8e4nv), mask=mask)
    else:
        tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_view(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``(tensor, outer stride, inner stride, inner size)`` addressing ``x``'s rows; a 3-D
    strided view is used as is, anything else is flattened to 2-D (copied only if it must)."""
    if x.dim() == 3 and x.stride(-1) == 1:
        return x, x.stride(0), x.stride(1), x.shape[1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, x2.stride(0), 0, 1


def _launch(x, residual, weight, eps, quant=False):
    """``(out, residual out, scales)``: ``out`` in x's dtype, or e4m3 with float32 per-row
    ``scales`` ``[rows, 1]`` when ``quant`` (else ``scales`` is None)."""
    hidden = x.shape[-1]
    x2, x_stride, x_stride_inner, inner = _rows_view(x)
    rows = x.numel() // hidden
    out = torch.empty(
        (rows, hidden), dtype=torch.float8_e4m3fn if quant else x.dtype, device=x.device
    )
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device) if quant else None
    block = triton.next_power_of_2(hidden)
    # Wide rows want more warps to keep registers per thread low.
    num_warps = min(max(block // 256, 1), 16)
    if residual is None:
        res2, res_out = out, out  # unused
    else:
        res2 = residual.reshape(-1, hidden)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        res_out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    quant_args = {"QUANT": True, "FP8_MAX_C": FP8_MAX, "MIN_SCALE": FP8_MIN_SCALE} if quant else {}
    if rows:
        _rms_norm_kernel[(rows,)](
            x2,
            res2,
            weight,
            out,
            res_out,
            scales if quant else out,
            x_stride,
            x_stride_inner,
            inner,
            res2.stride(0),
            out.stride(0),
            res_out.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=num_warps,
            **quant_args,
            **pdl_launch(x.device),
        )
    return out.view(x.shape), res_out.view(x.shape), scales


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim (any leading shape; a strided
    3-D view such as per-head q/k is read in place). Returns a new contiguous tensor."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual``; returns ``(rms_norm(residual), residual)`` as new tensors."""
    out, res, _ = _launch(x, residual, weight, eps)
    return out, res


def rms_norm_quant_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm`` written as e4m3 per token: ``(q [..., H], float32 scales [M, 1])``,
    bit-identical to ``quantize_fp8(rms_norm(x, weight, eps))``."""
    if x.dtype == torch.float32:
        return _plain_then_quantize(rms_norm(x, weight, eps))
    q, _, scales = _launch(x, None, weight, eps, quant=True)
    return q, scales


def fused_add_rms_norm_quant_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fused_add_rms_norm`` with the normed rows written as e4m3 per token:
    ``(q, float32 scales [M, 1], new residual)``."""
    if x.dtype == torch.float32:
        out, res = fused_add_rms_norm(x, residual, weight, eps)
        return (*_plain_then_quantize(out), res)
    q, res, scales = _launch(x, residual, weight, eps, quant=True)
    return q, scales, res


def _plain_then_quantize(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 rows: the plain kernel, then ``quantize_fp8``. On an H200 (2026-12-06) the
    ``QUANT`` variant's float32 rows had a row maximum one unit in the last place off the plain
    kernel's in 5 of 33 rows of 4096 (the two variants compile the same arithmetic
    differently), which would break the bit-identity the fusion promises; bf16 and fp16 rows,
    rounded before the maximum, matched. float32 FP8 models are rare, so they keep the two
    launches."""
    q, scales = quantize_fp8(y.reshape(-1, y.shape[-1]))
    return q.view(y.shape), scales
