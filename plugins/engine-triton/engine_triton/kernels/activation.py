"""Gated activations: ``silu(gate) * up`` and ``gelu_tanh(gate) * up`` over ``x = [gate | up]``.

Grid: (rows, column blocks). Arithmetic in float32, one rounding to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_triton.kernels.pdl import pdl_launch, pdl_wait


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
