"""W4A16 / W8A16 matmuls: ``wna16_linear`` (spec: ``engine.kernels.quantized.WNA16Linear``).

``prepack`` stores the weights as int32 ``[K / p, N]`` (p = 32 / bits values along the input
features per word, lowest bits first — GPTQ's own layout), the scales and zero points
transposed to ``[K / group, N]`` in the checkpoint's scale dtype, and an act-order permutation
as int32. Rows of ``N`` are contiguous, so a program's loads of its ``BLOCK_N`` features are
coalesced.

The product is reorganised so that the weights are never dequantized element by element: per
K tile (inside one group) ``sum_k x_k (q_kn - z_n) s_n = s_n (sum_k x_k q_kn - z_n sum_k x_k)``,
so each weight costs a shift, a mask, a conversion and one multiply-add; scale and zero point
apply once per tile and feature. The integer values are exact in bf16/fp16, so the tensor-core
path (``tl.dot`` of x against the integer tile) loses nothing either. The conversion is a bit
trick, not a type conversion (``_dot_operand``): Hopper converts integers to floats at a
quarter of its integer rate, which bounded these kernels by arithmetic instead of memory.

* ``_wna16_gemv_kernel`` — one row (batch-1 decode): a stream over the packed weights (half a
  byte per 4-bit weight, read once), several K tiles per iteration, each field turned into the
  float ``1 + q / 2**bits`` by a shift and an AND-OR (``_unit_field``), split-K with the
  last-arriving program summing the partials (``_store_split``: ``linear.py``'s scheme and
  workspace).
* ``_wna16_skinny_kernel`` — 2-16 rows: the same split-K stream, ``tl.dot`` with the rows
  padded to 16.
* ``_wna16_gemm_kernel`` — 17 to ``DENSE_MIN_ROWS - 1`` rows: tiled ``tl.dot`` GEMM with the
  same per-tile correction.
* ``DENSE_MIN_ROWS`` rows or more (prefill, large decode batches): the layer's weight
  dequantized to the activation dtype (``dequantize_t``) and multiplied by cuBLAS, which beat
  the fused GEMM 2-3.7x on the Llama-3.1-8B projections at 256 and 1,024 rows (H200,
  ``docs/benchmarks.md``).

4-bit layers of bf16 models on NVIDIA sm_80+ take none of these: ``prepack`` stores them in
torch's int4 tile layout and ``int4pack.py`` multiplies them (torch's kernel up to 16 rows,
dequantize + cuBLAS above), faster at every batch size measured (``INT4PACK``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.quantization.utils import pack_int32
from engine_triton.kernels import int4pack
from engine_triton.kernels.linear import _SCRATCH, _sm_count
from engine_triton.kernels.pdl import pdl_launch, pdl_wait

MAX_SKINNY_M = 16
# From this many rows on, the weight is dequantized to the activation dtype and multiplied by
# cuBLAS (``dequantize_t``): the fused GEMM unpacks every weight once per row tile, which costs
# more than writing and reading the dense weight once when there are hundreds of rows.
DENSE_MIN_ROWS = 256
# 4-bit layers of bf16 models on NVIDIA sm_80+ keep torch's int4 tile layout and multiply
# with its kernel (``int4pack.py``); False keeps them on the Triton kernels below.
INT4PACK = True
# 1.0f's bits, the one-row kernel's ``one_bits`` argument (see ``_unit_field``).
ONE_BITS = 0x3F800000


@triton.jit
def _unpack_tile(q_ptr, rows, cols, col_ok, stride_qk, BITS: tl.constexpr, R: tl.constexpr):
    """int32 words ``[R, BLOCK_N]`` at packed rows ``rows`` -> values ``[R, PACK, BLOCK_N]``
    (int32), value ``j`` of row ``r`` being input feature ``r * PACK + j``: each word loaded
    once (the GEMM's choice; the per-feature loads of ``_unpack_rows`` ran it 1.5x slower)."""
    PACK: tl.constexpr = 32 // BITS
    words = tl.load(
        q_ptr + rows.to(tl.int64)[:, None] * stride_qk + cols[None, :],
        mask=col_ok[None, :],
        other=0,
    )
    shifts = tl.arange(0, PACK) * BITS
    return (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)


@triton.jit
def _unpack_rows(q_ptr, k_offs, cols, col_ok, stride_qk, BITS: tl.constexpr):
    """The ``BITS``-bit values of input features ``k_offs`` ``[BLOCK_K]`` and output features
    ``cols`` ``[BLOCK_N]`` as an int32 ``[BLOCK_K, BLOCK_N]`` tile: feature ``k`` is field
    ``k % PACK`` of packed row ``k // PACK``. The ``PACK`` features of a word load the same
    address (served by L1: each word still leaves memory once), and the tile comes out in its
    final shape, with no reshape of a three-dimensional unpack."""
    PACK: tl.constexpr = 32 // BITS
    words = tl.load(
        q_ptr + (k_offs // PACK).to(tl.int64)[:, None] * stride_qk + cols[None, :],
        mask=col_ok[None, :],
        other=0,
    )
    return (words >> ((k_offs % PACK) * BITS)[:, None]) & ((1 << BITS) - 1)


@triton.jit
def _dot_operand(q, like, MAGIC: tl.constexpr):
    """Integer fields ``q`` as tensor-core operands of ``like``'s dtype. With ``MAGIC`` (128
    for bfloat16, 1024 for float16) the field is OR-ed into the mantissa of ``MAGIC`` and the
    bits reinterpreted: ``MAGIC + q`` exactly, for an integer AND/OR instead of two type
    conversions, which run at a quarter of the integer rate on Hopper and made the unpacking,
    not the memory, the bound. The caller subtracts ``MAGIC`` once per tile through the zero
    point. ``MAGIC`` 0 converts (float32 activations, fields too wide for the mantissa)."""
    if MAGIC == 128:
        return (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif MAGIC == 1024:
        return (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        # int -> float32 -> activation dtype: exact, and the interpreter converts int32 to
        # bfloat16 wrongly in one step.
        return q.to(tl.float32).to(like.dtype)


@triton.jit
def _group_scale_zero(s_ptr, z_ptr, g, stride_sg, cols, col_ok, MAGIC: tl.constexpr):
    """Group ``g``'s scales and zero points of features ``cols`` as float32, the zero point
    raised by ``MAGIC`` (see ``_dot_operand``)."""
    s = tl.load(s_ptr + g * stride_sg + cols, mask=col_ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * stride_sg + cols, mask=col_ok, other=0.0).to(tl.float32)
    return s, z + MAGIC


@triton.jit(do_not_specialize=["M"])
def _wna16_skinny_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    perm_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    K_PER_SPLIT,
    GROUP,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_ym,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    MAGIC: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Output features are masked, never clamped: they are the contiguous dimension of the
    # packed weights, and a clamp would hide that from the compiler (uncoalesced loads).
    col_ok = cols < N
    rows_c = tl.minimum(rows, M - 1)
    x_rows = x_ptr + rows_c.to(tl.int64)[:, None] * stride_xm
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        s, z = _group_scale_zero(s_ptr, z_ptr, k0 // GROUP, stride_sg, cols, col_ok, MAGIC)
        q = _unpack_rows(q_ptr, k0 + kk, cols, col_ok, stride_qk, BITS)
        offs = k0 + kk
        if HAS_PERM:
            offs = tl.load(perm_ptr + offs)
        xk = tl.load(x_rows + offs[None, :])  # [BLOCK_M, BLOCK_K]
        dq = tl.dot(xk, _dot_operand(q, xk, MAGIC), input_precision=PRECISION)
        xsum = tl.sum(xk.to(tl.float32), axis=1)
        acc += s[None, :] * (dq - z[None, :] * xsum[:, None])
    _store_split(
        acc, rows, cols, col_ok, M, N, pid_n, pid_k, part_ptr, counter_ptr, b_ptr, y_ptr,
        stride_ym, SPLIT_K, HAS_BIAS, BLOCK_M, BLOCK_N,
    )  # fmt: skip


@triton.jit
def _store_split(
    acc,
    rows,
    cols,
    col_ok,
    M,
    N,
    pid_n,
    pid_k,
    part_ptr,
    counter_ptr,
    b_ptr,
    y_ptr,
    stride_ym,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Write a program's float32 partial ``acc`` ``[BLOCK_M, BLOCK_N]``: straight to ``y``
    without split-K; with it, to the workspace, the last program of the column block to
    arrive summing the ``SPLIT_K`` partials (``linear.py``'s scheme) and adding the bias."""
    out_mask = (rows < M)[:, None] & col_ok[None, :]
    y_offs = rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    if SPLIT_K > 1:
        part_offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(part_ptr + pid_k * M * N + part_offs, acc, mask=out_mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            tl.atomic_xchg(counter_ptr + pid_n, 0)
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i in tl.static_range(SPLIT_K):
                total += tl.load(
                    part_ptr + i * M * N + part_offs, mask=out_mask, other=0.0, cache_modifier=".cg"
                )
            if HAS_BIAS:
                total += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + y_offs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _unit_field(words, j: tl.constexpr, BITS: tl.constexpr, one_bits):
    """Field ``j`` of every word as the float32 ``1 + q / 2**BITS``: the field is shifted to
    the top of the mantissa and OR-ed into 1.0's bits (a shift and one AND-OR per weight, no
    integer-to-float conversion, which runs at a quarter of the integer rate on Hopper, and no
    subtraction: the caller removes the 1 once per tile through ``sum(x)``). ``one_bits`` is
    1.0's bit pattern passed as a kernel argument: held in a register, the mask and the OR
    fuse into one three-input LOP3, where two immediates (one per instruction) took two."""
    shift: tl.constexpr = 23 - BITS - j * BITS
    if shift > 0:
        moved = words << shift
    elif shift < 0:
        moved = words >> (-shift)
    else:
        moved = words
    mant: tl.constexpr = ((1 << BITS) - 1) << (23 - BITS)
    return ((moved & mant) | one_bits).to(tl.float32, bitcast=True)


@triton.jit
def _wna16_gemv_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    perm_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    counter_ptr,
    N,
    K,
    K_PER_SPLIT,
    GROUP,
    stride_qk,
    stride_sg,
    one_bits,
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """One row (batch-1 decode): each iteration loads ``TILES`` K tiles of packed words at
    once, ``[TILES, BLOCK_K / PACK, BLOCK_N]`` (each tile inside one group), so that enough
    bytes are in flight per SM to stream at memory speed (one 4 KB tile per iteration left the
    kernel waiting on load latency at a third of the bandwidth). Per field, ``_unit_field``
    gives ``v = 1 + q / 2**BITS`` and one FMA accumulates ``x * v``; per tile and feature,
    ``sum x (q - z) = 2**BITS * sum(x v) - (2**BITS + z) * sum(x)``."""
    pdl_wait(USE_PDL)
    PACK: tl.constexpr = 32 // BITS
    R: tl.constexpr = BLOCK_K // PACK
    ONE: tl.constexpr = 1 << BITS
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N  # masked, not clamped (see the skinny kernel)
    t_idx = tl.arange(0, TILES)
    r_idx = tl.arange(0, R)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    acc = tl.zeros((TILES, R, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, TILES * BLOCK_K):
        tile_k = k0 + t_idx * BLOCK_K  # [TILES]
        t_ok = tile_k < k_hi
        sz_offs = (tile_k // GROUP)[:, None] * stride_sg + cols[None, :]
        sz_ok = t_ok[:, None] & col_ok[None, :]
        s = tl.load(s_ptr + sz_offs, mask=sz_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + sz_offs, mask=sz_ok, other=0.0).to(tl.float32)
        prow = (tile_k // PACK)[:, None] + r_idx[None, :]  # [TILES, R]
        words = tl.load(
            q_ptr + prow.to(tl.int64)[:, :, None] * stride_qk + cols[None, None, :],
            mask=t_ok[:, None, None] & col_ok[None, None, :],
            other=0,
        )
        part = tl.zeros((TILES, R, BLOCK_N), dtype=tl.float32)
        xs = tl.zeros((TILES, R), dtype=tl.float32)
        for j in tl.static_range(PACK):
            offs = tile_k[:, None] + r_idx[None, :] * PACK + j  # [TILES, R]
            if HAS_PERM:
                offs = tl.load(perm_ptr + offs, mask=t_ok[:, None], other=0)
            xj = tl.load(x_ptr + offs, mask=t_ok[:, None], other=0.0).to(tl.float32)
            part += _unit_field(words, j, BITS, one_bits) * xj[:, :, None]
            xs += xj
        acc += s[:, None, :] * (part * ONE - (z[:, None, :] + ONE) * xs[:, :, None])
    out = tl.sum(tl.sum(acc, axis=0), axis=0)[None, :]
    _store_split(
        out, tl.arange(0, 1), cols, col_ok, 1, N, pid_n, pid_k, part_ptr, counter_ptr, b_ptr,
        y_ptr, 0, SPLIT_K, HAS_BIAS, 1, BLOCK_N,
    )  # fmt: skip


@triton.jit
def _wna16_dequant_kernel(
    q_ptr,
    s_ptr,
    z_ptr,
    w_ptr,
    KP,
    N,
    GROUP,
    stride_qk,
    stride_sg,
    stride_wk,
    BITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The dense ``W^T`` ``[K, N]`` in the activation dtype, ``(q - z) * s``, for batches
    large enough that cuBLAS on the dense weight beats the fused GEMM (the weight is written
    once and read once more: cheap next to a GEMM over hundreds of rows)."""
    PACK: tl.constexpr = 32 // BITS
    prow = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (prow < KP)[:, None] & (cols < N)[None, :]
    words = tl.load(q_ptr + prow.to(tl.int64)[:, None] * stride_qk + cols[None, :], mask=ok)
    shifts = tl.arange(0, PACK) * BITS
    q = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)  # [R, PACK, N]
    k = prow[:, None] * PACK + tl.arange(0, PACK)[None, :]  # [R, PACK]
    sz_offs = (k // GROUP)[:, :, None] * stride_sg + cols[None, None, :]
    ok3 = ok[:, None, :]
    s = tl.load(s_ptr + sz_offs, mask=ok3, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + sz_offs, mask=ok3, other=0.0).to(tl.float32)
    w = (q.to(tl.float32) - z) * s
    tl.store(
        w_ptr + k.to(tl.int64)[:, :, None] * stride_wk + cols[None, None, :],
        w.to(w_ptr.dtype.element_ty),
        mask=ok3,
    )


# M changes from step to step: not specialized (one compiled variant for every batch size).
@triton.jit(do_not_specialize=["M"])
def _wna16_gemm_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    perm_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    GROUP,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_ym,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    MAGIC: tl.constexpr,
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
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N  # masked, not clamped (see the skinny kernel)
    rows_c = tl.minimum(rows, M - 1)
    x_rows = x_ptr + rows_c.to(tl.int64)[:, None] * stride_xm
    PACK: tl.constexpr = 32 // BITS
    R: tl.constexpr = BLOCK_K // PACK
    r_idx = tl.arange(0, R)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        s, z = _group_scale_zero(s_ptr, z_ptr, k0 // GROUP, stride_sg, cols, col_ok, MAGIC)
        q = tl.reshape(
            _unpack_tile(q_ptr, k0 // PACK + r_idx, cols, col_ok, stride_qk, BITS, R),
            (BLOCK_K, BLOCK_N),
        )
        offs = k0 + kk
        if HAS_PERM:
            offs = tl.load(perm_ptr + offs)
        xk = tl.load(x_rows + offs[None, :])
        dq = tl.dot(xk, _dot_operand(q, xk, MAGIC), input_precision=PRECISION)
        xsum = tl.sum(xk.to(tl.float32), axis=1)
        acc += s[None, :] * (dq - z[None, :] * xsum[:, None])
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    mask = (rows < M)[:, None] & col_ok[None, :]
    tl.store(
        y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=mask,
    )


def _block_k(group: int, k: int, pack: int, limit: int) -> int:
    """The largest power-of-two K tile (at most ``limit``) inside one group that divides K."""
    block = limit
    while block > pack and (group % block or k % block):
        block //= 2
    if group % block or k % block:
        raise ValueError(f"no K tile fits group {group} and K {k}")
    return block


def _gemv_config(n: int, k: int, group: int, pack: int, sms: int):
    """(block_n, block_k, tiles, num_warps, split_k) of the one-row kernel: the fastest of the
    H200 sweep of 2026-12-06 on the Llama-3.1-8B projections (docs/benchmarks.md): 32
    features, four 128-wide K tiles per iteration, 2 warps and K split in 4 (qkv 12.38 us
    against 16.57 for 64 features with 4 warps and the split filling the SMs three times);
    for very wide layers (gate_up, N = 28,672: enough feature blocks already) 64 features, one
    tile per iteration, 4 warps (39.40 us against 54.99). K is split in 4, or further (up to
    16) until the programs fill the SMs twice, as far as K holds whole iterations."""
    block_k = _block_k(group, k, pack, 128)
    if n >= 16384:
        block_n, tiles, warps = 64, 1, 4
    else:
        block_n, tiles, warps = 32, max(1, 512 // block_k), 2
    split = 1
    while (
        (split < 4 or triton.cdiv(n, block_n) * split < 2 * sms)
        and split < 16
        and k % (block_k * split * 2) == 0
        and k // (split * 2) >= tiles * block_k
    ):
        split *= 2
    return block_n, block_k, tiles, warps, split


def _skinny_config(n: int, k: int, group: int, pack: int, sms: int):
    """(block_n, block_k, num_warps, split_k) of the tensor-core kernel for 2-16 rows: split
    K until about two waves over the SMs."""
    block_k = _block_k(group, k, pack, 128)
    block_n = 64
    while block_n > 32 and triton.cdiv(n, block_n) < 2 * sms:
        block_n //= 2
    split = 1
    while (
        triton.cdiv(n, block_n) * split < 2 * sms
        and split < 16
        and k % (block_k * split * 2) == 0
        and k // (split * 2) >= 2 * block_k
    ):
        split *= 2
    return block_n, block_k, 4, split


def _gemm_config(
    m: int, n: int, k: int, group: int, pack: int, x_bytes: int = 2
) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, block_k, num_warps, num_stages) of the tiled GEMM: the fastest of
    ``quant_benchmark --sweep`` on the Llama-3.1-8B projections (H100, 2026-12-05): 128-wide K
    tiles everywhere; 128x64 tiles where N is small (o, down), 128x128 with 8 warps for wide N
    or many rows. ``x_bytes``: the activations' element size; float32 ones take fewer stages
    so that the pipeline fits in shared memory."""
    block_k = _block_k(group, k, pack, 128)
    if m <= 32:
        config = 32, 128, block_k, 4, 3
    elif m <= 64 and n >= 6144:
        config = 64, 128, block_k, 4, 3
    elif m <= 256 and n < 6144:
        config = 128, 64, block_k, 4, 4
    else:
        config = 128, 128, block_k, 8, 3
    return *config[:4], _fit_stages(*config[:3], config[4], pack, x_bytes)


#: Shared memory the GEMM's software pipeline may take, leaving room for the epilogue's
#: scratch under the 227 KiB an sm_90 block can have, so that a configuration tuned for 16-bit
#: activations still launches with float32 ones (on an H200 one asked for 236 KiB with
#: float32 activations and failed to launch). 16-bit configurations fit as tuned.
_PIPELINE_SMEM = 160 * 1024


def _fit_stages(
    block_m: int, block_n: int, block_k: int, stages: int, pack: int, x_bytes: int
) -> int:
    """``stages`` lowered (to 2 at least) until each stage's activation tile and packed weight
    words fit ``_PIPELINE_SMEM`` together."""
    per_stage = block_m * block_k * x_bytes + (block_k // pack) * block_n * 4
    while stages > 2 and stages * per_stage > _PIPELINE_SMEM:
        stages -= 1
    return stages


def _magic(dtype: torch.dtype, bits: int) -> int:
    """``_dot_operand``'s offset for activations of ``dtype``: the power of two whose mantissa
    holds every ``bits``-bit field exactly (bfloat16: 7 bits, float16: 10), 0 to convert."""
    if dtype == torch.bfloat16 and bits <= 7:
        return 128
    if dtype == torch.float16 and bits <= 10:
        return 1024
    return 0


def dequantize_t(
    packed: dict[str, torch.Tensor], *, bits: int, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The dense transposed weight ``[K, N]`` of a prepacked layer, ``(q - z) * s`` in
    ``dtype`` (rows in the packed order: with act order, multiply ``x[:, perm]``)."""
    q, s, z = packed["qweight"], packed["scales"], packed["zeros"]
    pack = 32 // bits
    k, n = q.shape[0] * pack, q.shape[1]
    w_t = torch.empty((k, n), dtype=dtype, device=q.device)
    block_r, block_n = 8, 128
    grid = (triton.cdiv(q.shape[0], block_r), triton.cdiv(n, block_n))
    _wna16_dequant_kernel[grid](
        q, s, z, w_t, q.shape[0], n, group_size, q.stride(0), s.stride(0), w_t.stride(0),
        BITS=bits, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    return w_t


class TritonWNA16Linear:
    """``wna16_linear`` through the Triton kernels above."""

    def prepack(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        *,
        bits: int,
        group_size: int,
        perm: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> dict[str, torch.Tensor]:
        n, k = qweight.shape
        if INT4PACK and int4pack.supported(n, k, bits, group_size, qweight.device, dtype):
            packed = int4pack.pack(qweight, scales, zeros, group_size)
            if perm is not None:
                packed["perm"] = perm.to(torch.int32).contiguous()
            return packed
        # Scales travel with the weights: 2 bytes each where that is exact (checkpoints store
        # float16; the loader holds them in float32), zero points as float16 integers.
        scale_dtype = scales.dtype
        if scale_dtype == torch.float32 and torch.equal(scales.half().float(), scales):
            scale_dtype = torch.float16
        packed = {
            "qweight": pack_int32(qweight.t().contiguous(), bits, dim=0),  # [K / p, N]
            "scales": scales.t().to(scale_dtype).contiguous(),  # [K / group, N]
            "zeros": zeros.t().to(scale_dtype).contiguous(),
        }
        if perm is not None:
            packed["perm"] = perm.to(torch.int32).contiguous()
        return packed

    def __call__(
        self,
        x: torch.Tensor,
        packed: dict[str, torch.Tensor],
        *,
        bits: int,
        group_size: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        perm = packed.get("perm")
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if "int4pack" in packed:
            y = int4pack.linear(x2, packed, group_size, bias, perm)
            return y.view(*x.shape[:-1], y.shape[-1])
        q, s, z = packed["qweight"], packed["scales"], packed["zeros"]
        m, k = x2.shape
        n = q.shape[1]
        pack = 32 // bits
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if m == 0:
            return y.view(*x.shape[:-1], n)
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        common = dict(
            BITS=bits,
            HAS_PERM=perm is not None,
            HAS_BIAS=bias is not None,
            PRECISION=precision,
            MAGIC=_magic(x.dtype, bits),
        )
        perm_arg = perm if perm is not None else q
        bias_arg = bias if bias is not None else s
        if m == 1:
            block_n, block_k, tiles, warps, split = _gemv_config(
                n, k, group_size, pack, _sm_count(x.device)
            )
            grid_n = triton.cdiv(n, block_n)
            part, counters = _SCRATCH.get(x.device, split * n, grid_n) if split > 1 else (y, y)
            _wna16_gemv_kernel[(grid_n, split)](
                x2, q, s, z, perm_arg, bias_arg, y, part, counters,
                n, k, k // split, group_size, q.stride(0), s.stride(0), ONE_BITS,
                BITS=bits, BLOCK_N=block_n, BLOCK_K=block_k, TILES=tiles, SPLIT_K=split,
                HAS_PERM=perm is not None, HAS_BIAS=bias is not None, num_warps=warps,
                **pdl_launch(x.device),
            )  # fmt: skip
        elif m <= MAX_SKINNY_M:
            block_n, block_k, warps, split = _skinny_config(
                n, k, group_size, pack, _sm_count(x.device)
            )
            grid_n = triton.cdiv(n, block_n)
            if split > 1:
                part, counters = _SCRATCH.get(x.device, split * m * n, grid_n)
            else:
                part, counters = y, y
            _wna16_skinny_kernel[(grid_n, split)](
                x2, q, s, z, perm_arg, bias_arg, y, part, counters,
                m, n, k, k // split, group_size,
                x2.stride(0), q.stride(0), s.stride(0), y.stride(0),
                BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
                num_warps=warps, num_stages=3, **common, **pdl_launch(x.device),
            )  # fmt: skip
        elif m >= DENSE_MIN_ROWS:
            w_t = dequantize_t(packed, bits=bits, group_size=group_size, dtype=x.dtype)
            xp = x2.index_select(1, perm) if perm is not None else x2
            torch.mm(xp, w_t, out=y)
            if bias is not None:
                y += bias
        else:
            block_m, block_n, block_k, warps, stages = _gemm_config(
                m, n, k, group_size, pack, x.element_size()
            )
            grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
            _wna16_gemm_kernel[grid](
                x2, q, s, z, perm_arg, bias_arg, y,
                m, n, k, group_size,
                x2.stride(0), q.stride(0), s.stride(0), y.stride(0),
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
                num_warps=warps, num_stages=stages, **common,
            )  # fmt: skip
        return y.view(*x.shape[:-1], n)


wna16_linear = TritonWNA16Linear()
