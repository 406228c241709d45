"""FP8 (e4m3) matmuls: ``fp8_linear`` and ``fp8_block_linear`` (spec:
``engine.kernels.quantized``).

Three kernels:

* ``_quant_fp8_kernel`` — activations to e4m3: one program per (row, group) computes the
  group's absolute maximum (dynamic scale ``amax / 448``, at least ``FP8_MIN_SCALE``) or takes
  the static scale, then writes the quantized values and the scale. A group is the whole row
  for per-token scales, 128 features for block-wise FP8.
* ``_fp8_skinny_kernel`` — decode batches (M <= 16): a stream over the FP8 weight ``[N, K]``
  (1 byte per weight, rows contiguous), ``BLOCK_N`` output features per program, split-K with
  the last-arriving program reducing the partials (the scheme of ``linear.py``, sharing its
  workspace). x is e4m3 with a per-row scale (W8A8) or the activation dtype (weight-only); the
  weight scale (per channel) and the row scale multiply the float32 sum once at the end.
* ``_fp8_gemm_kernel`` — tiled GEMM on the tensor cores for larger M: e4m3 x e4m3 products
  (W8A8) or the weight tile converted to the activation dtype (weight-only checkpoints). Both
  need Triton's e4m3 conversion: CUDA sm_89+ (the quantization methods refuse older GPUs).
  With ``BLOCK_SCALED`` each K tile's partial product is scaled by its activation group's and
  weight block's scales before it is accumulated (DeepSeek-style 128x128 blocks).

``fp8_linear`` for W8A8 with M > 16 on sm_90+ and bfloat16 activations uses
``torch._scaled_mm`` (cuBLASLt, row-wise scales) instead of the tiled kernel.

``fp8_linear`` also takes activations its producer already quantized per token
(``engine.kernels.quantized.Fp8Activation``, from the ``*_quant_fp8`` norm and activation
kernels): from ``MAX_SKINNY_M + 1`` rows (``fp8_linear.fp8_activation_min_rows``), where it
would have run ``quantize_fp8`` on ``x`` itself, it skips that launch and multiplies the given
e4m3 rows and scales. (Should one arrive with fewer rows, it is multiplied W8A8 by the skinny
kernel: correct, though not what an unquantized ``x`` would get there.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.quantized import FP8_MAX, FP8_MIN_SCALE, Fp8Activation
from engine_triton.kernels import pdl
from engine_triton.kernels.linear import _SCRATCH, SM_COUNT_FALLBACK, _sm_count, m_bucket
from engine_triton.kernels.pdl import pdl_launch, pdl_prefetch_wait, pdl_wait

MAX_SKINNY_M = 16
# Decode batches (M <= 16) of a W8A8 layer skip the activation quantization and multiply the
# e4m3 weights with the activations as they are: the skinny kernel streams the weights either
# way (no tensor-core throughput to gain from e4m3 activations at these sizes), the quantizer
# was a second launch per projection (13% of a batch-1 Llama-3.1-8B step on an H100), and the
# result is closer to the unquantized product, not further. Measured on an H100 (2026-12-05,
# ``quant_benchmark``): the 32 layers' projections 3.383 ms W8A8 against 2.730 ms this way.
DECODE_WEIGHT_ONLY = True
# Device types the kernels run on (interpreter tests add "cpu").
DEVICE_TYPES = ["cuda"]
_QUANT_BLOCK = 1024


# ---- activations to e4m3 ------------------------------------------------------------------------
@triton.jit
def _quant_fp8_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    static_ptr,
    GROUP,
    stride_xm,
    stride_qm,
    stride_sm,
    BLOCK: tl.constexpr,
    STATIC: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    g = tl.program_id(1)
    start = g * GROUP
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    q_row = q_ptr + row.to(tl.int64) * stride_qm
    offs = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(start, start + GROUP, BLOCK):
            ok = (k0 + offs) < start + GROUP
            x = tl.load(x_row + k0 + offs, mask=ok, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), FP8_MAX_C), MIN_SCALE)
        tl.store(s_ptr + row.to(tl.int64) * stride_sm + g, scale)
    for k0 in range(start, start + GROUP, BLOCK):
        ok = (k0 + offs) < start + GROUP
        x = tl.load(x_row + k0 + offs, mask=ok, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX_C), FP8_MAX_C)
        tl.store(q_row + k0 + offs, q.to(tl.float8e4nv), mask=ok)


def quantize_fp8(
    x: torch.Tensor, input_scale: torch.Tensor | None = None, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` -> (e4m3 ``[M, K]``, float32 scales ``[M, K / group]``): dynamic per token
    (``group_size`` None: one group per row) or per group; with ``input_scale`` (``[1]``) the
    static scale, returned as given."""
    m, k = x.shape
    group = k if group_size is None else group_size
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    if input_scale is not None:
        scales = input_scale.reshape(1).to(torch.float32)
        s_arg = scales
    else:
        scales = torch.empty((m, k // group), dtype=torch.float32, device=x.device)
        s_arg = scales
    if m == 0:
        return q, scales
    block = min(_QUANT_BLOCK, triton.next_power_of_2(group))
    _quant_fp8_kernel[(m, k // group)](
        x,
        q,
        s_arg,
        s_arg,
        group,
        x.stride(0),
        q.stride(0),
        scales.stride(0) if input_scale is None else 0,
        BLOCK=block,
        STATIC=input_scale is not None,
        FP8_MAX_C=FP8_MAX,
        MIN_SCALE=FP8_MIN_SCALE,
        num_warps=4,
        **pdl_launch(x.device),
    )
    return q, scales


# ---- decode: the skinny GEMV ---------------------------------------------------------------------
@triton.jit(do_not_specialize=["M"])
def _fp8_skinny_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    K_PER_SPLIT,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT: tl.constexpr,
    X_SCALE: tl.constexpr,  # 0: none (weight-only), 1: per row, 2: one static scale
    W_SCALE_SCALAR: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_c = tl.minimum(rows, M - 1)
    cols_c = tl.minimum(cols, N - 1)
    x_rows = x_ptr + rows_c.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + cols_c.to(tl.int64)[:, None] * stride_wn
    kk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    if PREFETCH:  # one row, whole K tiles, PDL: the first weight tile loads before the wait
        w_first = pdl_prefetch_wait(w_rows + (k_lo + kk)[None, :], USE_PDL)
    else:
        pdl_wait(USE_PDL)

    if DOT:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs = k0 + kk
            if EVEN_K:
                w = tl.load(w_rows + offs[None, :])
                x = tl.load(x_rows + offs[None, :])
            else:
                k_ok = offs < k_hi
                w = tl.load(w_rows + offs[None, :], mask=k_ok[None, :], other=0.0)
                x = tl.load(x_rows + offs[None, :], mask=k_ok[None, :], other=0.0)
            if X_SCALE == 0:
                w = w.to(x.dtype)
            acc_t = tl.dot(w, tl.trans(x), acc_t)
        acc = tl.trans(acc_t)
    elif BLOCK_M == 1:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        k_start = k_lo
        if PREFETCH:
            acc2 += w_first.to(tl.float32) * tl.load(x_ptr + k_lo + kk).to(tl.float32)[None, :]
            k_start = k_lo + BLOCK_K
        for k0 in range(k_start, k_hi, BLOCK_K):
            offs = k0 + kk
            if EVEN_K:
                w = tl.load(w_rows + offs[None, :])
                x = tl.load(x_ptr + offs)
            else:
                k_ok = offs < k_hi
                w = tl.load(w_rows + offs[None, :], mask=k_ok[None, :], other=0.0)
                x = tl.load(x_ptr + offs, mask=k_ok, other=0.0)
            acc2 += w.to(tl.float32) * x.to(tl.float32)[None, :]
        acc = tl.sum(acc2, axis=1)[None, :]
    else:
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs = k0 + kk
            if EVEN_K:
                w = tl.load(w_rows + offs[None, :])
                x = tl.load(x_rows + offs[None, :])
            else:
                k_ok = offs < k_hi
                w = tl.load(w_rows + offs[None, :], mask=k_ok[None, :], other=0.0)
                x = tl.load(x_rows + offs[None, :], mask=k_ok[None, :], other=0.0)
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        acc = tl.sum(acc3, axis=2)

    out_mask = (rows < M)[:, None] & (cols < N)[None, :]
    y_offs = rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    if SPLIT_K > 1:
        part_offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(part_ptr + pid_k * M * N + part_offs, acc, mask=out_mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            tl.atomic_xchg(counter_ptr + pid_n, 0)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(
                    part_ptr + s * M * N + part_offs, mask=out_mask, other=0.0, cache_modifier=".cg"
                )
            _fp8_skinny_epilogue(
                acc, xs_ptr, ws_ptr, b_ptr, y_ptr, y_offs, out_mask, rows_c, cols_c,
                X_SCALE, W_SCALE_SCALAR, HAS_BIAS,
            )  # fmt: skip
    else:
        _fp8_skinny_epilogue(
            acc, xs_ptr, ws_ptr, b_ptr, y_ptr, y_offs, out_mask, rows_c, cols_c,
            X_SCALE, W_SCALE_SCALAR, HAS_BIAS,
        )  # fmt: skip


@triton.jit
def _fp8_skinny_epilogue(
    acc,
    xs_ptr,
    ws_ptr,
    b_ptr,
    y_ptr,
    y_offs,
    out_mask,
    rows_c,
    cols_c,
    X_SCALE: tl.constexpr,
    W_SCALE_SCALAR: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    if X_SCALE == 1:
        acc = acc * tl.load(xs_ptr + rows_c)[:, None]
    elif X_SCALE == 2:
        acc = acc * tl.load(xs_ptr)
    if W_SCALE_SCALAR:
        acc = acc * tl.load(ws_ptr)
    else:
        acc = acc * tl.load(ws_ptr + cols_c)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols_c).to(tl.float32)[None, :]
    tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def _skinny_config(m: int, n: int, k: int, sms: int) -> tuple[int, int, int, int, bool]:
    """(block_n, block_k, num_warps, split_k, dot) for the skinny kernel: one byte per weight,
    so twice the K of the bf16 kernel's rule per load; split K until about two waves."""
    mb = m_bucket(m)
    dot = mb >= 8
    if dot:
        block_n, block_k, warps = 64, 128, 4
    elif mb == 1:
        # The H200 sweep of 2026-12-06 (docs/benchmarks.md): 8 rows of 1,024 bytes (512 for
        # the widest layers) with 4 warps, 1-4% faster on the 8B projections than the bf16
        # kernel's choice at the same bytes per load (4 rows x 1,024, 2 warps).
        block_n, block_k, warps = 8, 512 if n > 4096 else 1024, 4
    elif mb == 2:
        block_n, block_k, warps = 16, 256, 4
    else:
        block_n, block_k, warps = 16, 128, 4
    min_n = 16 if dot else 4
    while block_n > min_n and triton.cdiv(n, block_n) < 2 * sms:
        block_n //= 2
    while block_k > 32 and block_k > k:
        block_k //= 2
    split = 1
    while (
        triton.cdiv(n, block_n) * split < 2 * sms
        and split < 8
        and k % (block_k * split * 2) == 0
        and k // (split * 2) >= 2 * block_k
    ):
        split *= 2
    return block_n, block_k, warps, split, dot


def fp8_skinny(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    static_x_scale: bool = False,
) -> torch.Tensor:
    """``(x * x_scale) @ (weight * weight_scale)^T + bias`` for M <= 16 rows: ``x`` e4m3 with
    ``x_scale`` ``[M, 1]`` (or one static scale), or unquantized (``x_scale`` None)."""
    m, k = x.shape
    n = weight.shape[0]
    block_n, block_k, warps, split, dot = _skinny_config(m, n, k, _sm_count(x.device))
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    grid_n = triton.cdiv(n, block_n)
    if split > 1:
        part, counters = _SCRATCH.get(x.device, split * m * n, grid_n)
    else:
        part, counters = y, y
    x_mode = 0 if x_scale is None else (2 if static_x_scale else 1)
    even_k = k % (block_k * split) == 0
    launch = pdl_launch(x.device)
    _fp8_skinny_kernel[(grid_n, split)](
        x,
        x_scale if x_scale is not None else weight_scale,
        weight,
        weight_scale,
        bias if bias is not None else weight_scale,
        y,
        part,
        counters,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        BLOCK_M=16 if dot else m_bucket(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split,
        DOT=dot,
        X_SCALE=x_mode,
        W_SCALE_SCALAR=weight_scale.numel() == 1,
        HAS_BIAS=bias is not None,
        EVEN_K=even_k,
        num_warps=warps,
        num_stages=3,
        PREFETCH=pdl.PREFETCH_WEIGHTS and bool(launch) and not dot and m_bucket(m) == 1 and even_k,
        **launch,
    )
    return y


# ---- larger batches: the tiled GEMM ------------------------------------------------------------
# M changes from step to step: not specialized (one compiled variant for every batch size).
@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    A_SCALE: tl.constexpr,  # 0: none, 1: per row (or per row and K block), 2: one scale
    BLOCK_SCALED: tl.constexpr,
    BS_N: tl.constexpr,
    W_SCALE_SCALAR: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_c = tl.minimum(offs_m, M - 1)
    cols_c = tl.minimum(offs_n, N - 1)
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_c.to(tl.int64)[:, None] * stride_am + kk[None, :]
    b_ptrs = b_ptr + cols_c.to(tl.int64)[None, :] * stride_bn + kk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + kk) < K
        a = tl.load(a_ptrs + k0, mask=k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs + k0, mask=k_ok[:, None], other=0.0)
        if A_SCALE == 0:
            b = b.to(a.dtype)
        if BLOCK_SCALED:
            part = tl.dot(a, b, input_precision=PRECISION)
            kb = k0 // BLOCK_K
            b_s = tl.load(bs_ptr + (cols_c // BS_N) * stride_bsn + kb)
            if A_SCALE == 1:
                a_s = tl.load(as_ptr + rows_c * stride_asm + kb)
                acc += part * a_s[:, None] * b_s[None, :]
            else:
                acc += part * b_s[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if not BLOCK_SCALED:
        if A_SCALE == 1:
            acc = acc * tl.load(as_ptr + rows_c * stride_asm)[:, None]
        elif A_SCALE == 2:
            acc = acc * tl.load(as_ptr)
        if W_SCALE_SCALAR:
            acc = acc * tl.load(bs_ptr)
        else:
            acc = acc * tl.load(bs_ptr + cols_c)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols_c).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    block: tuple[int, int] | None = None,
    static_a_scale: bool = False,
) -> torch.Tensor:
    """``a @ weight^T`` with scales (see the module docstring): ``a`` e4m3 with ``a_scale``
    (per row ``[M, 1]``, per row and K block ``[M, K / bk]``, or static ``[1]``) or unquantized
    (``a_scale`` None); ``w_scale`` per channel ``[N]``/``[1]``, or ``[N / bn, K / bk]``
    block scales with ``block``."""
    m, k = a.shape
    n = weight.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    if block is not None:
        block_m, block_n, block_k = 64, min(128, block[0]), block[1]
        while block_n > block[0] or block[0] % block_n:
            block_n //= 2
    else:
        block_m, block_n, block_k = 64, 128, 128 if a.element_size() == 1 else 64
    if m <= 32:
        block_m = 32 if m > 16 else 16
    a_mode = 0 if a_scale is None else (2 if static_a_scale else 1)
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_gemm_kernel[grid](
        a,
        a_scale if a_scale is not None else w_scale,
        weight,
        w_scale,
        bias if bias is not None else w_scale,
        c,
        m,
        n,
        k,
        a.stride(0),
        a_scale.stride(0) if a_scale is not None and a_scale.dim() == 2 else 0,
        weight.stride(0),
        w_scale.stride(0) if w_scale.dim() == 2 else 0,
        c.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=8,
        A_SCALE=a_mode,
        BLOCK_SCALED=block is not None,
        BS_N=block[0] if block is not None else 1,
        W_SCALE_SCALAR=w_scale.numel() == 1,
        HAS_BIAS=bias is not None,
        PRECISION=precision,
        num_warps=4,
        num_stages=3,
    )
    return c


# ---- the registered ops ---------------------------------------------------------------------------
_CAPABILITY: dict[torch.device, tuple[int, int]] = {}


def _scaled_mm_serves(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
) -> bool:
    """cuBLASLt's row-wise FP8 GEMM: Hopper or newer, bf16 output (``out_dtype``, default
    ``x``'s dtype), sizes multiples of 16."""
    if x.device.type != "cuda" or (out_dtype or x.dtype) != torch.bfloat16:
        return False
    n, k = weight.shape
    if n % 16 or k % 16:
        return False
    if x.device not in _CAPABILITY:
        _CAPABILITY[x.device] = torch.cuda.get_device_capability(x.device)
    return _CAPABILITY[x.device] >= (9, 0)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def fp8_linear(
    x: torch.Tensor | Fp8Activation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation_quant: bool = True,
) -> torch.Tensor:
    """See ``engine.kernels.quantized.fp8_linear``."""
    n = weight.shape[0]
    ws = weight_scale.to(torch.float32)
    if isinstance(x, Fp8Activation):
        xq, xs = _rows(x.data), x.scale
        y = _fp8_w8a8(xq, xs, weight, ws, bias, x.dtype, static=False)
        return y.view(*x.shape[:-1], n)
    x2 = _rows(x)
    m = x2.shape[0]
    if activation_quant and not (DECODE_WEIGHT_ONLY and m <= MAX_SKINNY_M):
        xq, xs = quantize_fp8(x2, input_scale)
        y = _fp8_w8a8(xq, xs, weight, ws, bias, x.dtype, static=input_scale is not None)
    elif m <= MAX_SKINNY_M:
        y = fp8_skinny(x2, None, weight, ws, bias, x.dtype)
    else:
        y = fp8_gemm(x2, None, weight, ws, bias, x.dtype)
    return y.view(*x.shape[:-1], n)


# A producer may hand fp8_linear its activations quantized from this many rows on: above the
# skinny kernel's rows, where every W8A8 call quantizes per token (at or below, the call may be
# multiplied weight-only: DECODE_WEIGHT_ONLY).
fp8_linear.fp8_activation_min_rows = MAX_SKINNY_M + 1  # type: ignore[attr-defined]


def _fp8_w8a8(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    ws: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    static: bool,
) -> torch.Tensor:
    """e4m3 rows ``xq`` ``[M, K]`` with scales ``xs`` (``[M, 1]``, or ``[1]`` when
    ``static``) times the e4m3 weight: the skinny kernel, cuBLASLt or the tiled GEMM."""
    m = xq.shape[0]
    n = weight.shape[0]
    if m <= MAX_SKINNY_M:
        y = fp8_skinny(xq, xs, weight, ws, bias, out_dtype, static_x_scale=static)
    elif _scaled_mm_serves(xq, weight, out_dtype):
        scale_a = xs.expand(m, 1).contiguous() if static else xs
        scale_b = ws.expand(n).reshape(1, n).contiguous()
        y = torch._scaled_mm(xq, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
        if bias is not None:
            y = y + bias
    else:
        y = fp8_gemm(xq, xs, weight, ws, bias, out_dtype, static_a_scale=static)
    return y


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: tuple[int, int] | list[int],
    bias: torch.Tensor | None = None,
    activation_quant: bool = True,
) -> torch.Tensor:
    """See ``engine.kernels.quantized.fp8_block_linear``: activations quantized per token and
    ``bk`` group, then the block-scaled tiled GEMM (one K tile per scale block)."""
    bn, bk = int(block_size[0]), int(block_size[1])
    x2 = _rows(x)
    scale = weight_scale_inv.to(torch.float32).contiguous()
    if activation_quant:
        xq, xs = quantize_fp8(x2, None, group_size=bk)
        y = fp8_gemm(xq, xs, weight, scale, bias, x.dtype, block=(bn, bk))
    else:
        y = fp8_gemm(x2, None, weight, scale, bias, x.dtype, block=(bn, bk))
    return y.view(*x.shape[:-1], weight.shape[0])


__all__ = ["fp8_linear", "fp8_block_linear", "quantize_fp8", "SM_COUNT_FALLBACK"]
