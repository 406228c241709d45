"""RMSNorm and fused residual-add + RMSNorm as Triton kernels.

One program normalises one row. Arithmetic is float32 and the result is cast back to the input
dtype, as ``engine.kernels.reference`` specifies; the fused variant rounds the sum to the input
dtype first and normalises that rounded sum, so both outputs match the reference bit-for-bit in
float32 and to rounding in bf16/fp16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_triton.kernels.pdl import pdl_launch, pdl_wait


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
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


def _launch(x, residual, weight, eps):
    hidden = x.shape[-1]
    x2, x_stride, x_stride_inner, inner = _rows_view(x)
    rows = x.numel() // hidden
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(hidden)
    # Wide rows want more warps to keep registers per thread low.
    num_warps = min(max(block // 256, 1), 16)
    if residual is None:
        res2, res_out = out, out  # unused
    else:
        res2 = residual.reshape(-1, hidden)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        res_out = torch.empty_like(out)
    if rows:
        _rms_norm_kernel[(rows,)](
            x2,
            res2,
            weight,
            out,
            res_out,
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
            **pdl_launch(x.device),
        )
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim (any leading shape; a strided
    3-D view such as per-head q/k is read in place). Returns a new contiguous tensor."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual``; returns ``(rms_norm(residual), residual)`` as new tensors."""
    return _launch(x, residual, weight, eps)
