"""A W4A16 GEMM over torch's int4 tile layout (``int4pack.py``) for decode batches of 17 to a
few hundred rows, where ``int4pack`` otherwise dequantizes the whole weight to bf16 and calls
cuBLAS (writing and reading every weight as bf16 on every call: ~31 GB a step at the
Llama-3.1-8B shape, against the 3.5 GB of 4-bit weights).

It reads the words exactly as ``torch._convert_weight_to_int4pack`` stores them (a layer keeps
one copy of its weights; torch's kernel still serves up to 16 rows) and multiplies

    y^T [N, M] = W [N, K] @ x^T [K, M]

so that the dequantized weight tile is the *A* operand of the MMA and the rows of x are B: on
Hopper, wgmma takes A from registers, where the weight is dequantized, and B (x^T, staged by
the pipelined loads) from shared memory. A program owns ``BLOCK_N`` outputs (weight rows) by
``BLOCK_M`` rows of x; ``BLOCK_M`` is M rounded up to a power of two (16 to a configured cap,
256 at most), so up to the cap each weight is read and unpacked once per call. Above the cap
the programs of one output block's row blocks are adjacent in the grid (``program_id(0)``),
so the second row block reads the 4-bit tile from L2.

**No reshapes of the weight tile.** For output row ``n`` the layout keeps, per k super-tile of
``KT = 16 * INNER`` inputs, ``4 * P`` consecutive int32 words (``P = INNER / 2``): lane
``t = 4 (n % 8) + c`` of row tile ``n // 8`` owns words ``[t, 0..P)``, so word ``w = c * P + p``
of the row sits at ``(n // 8) * stride + ko * 32 P + (n % 8) * 4 P + w``. A program loads, per
K block of ``8 BLOCK_KW`` inputs, a plain 2-D tile of the rows' words read as 16-bit halves,
``[BLOCK_N, 2 BLOCK_KW]`` int16, and takes nibble ``j`` of every half: field ``4 h + j`` of its
word. Nibble ``j`` of the tile is a ``[BLOCK_N, 2 BLOCK_KW]`` bf16 operand for one ``tl.dot``:
four dots per K block. The inputs those fields hold are gathered into the same positions of x
once per call (``x_order``: one ``index_select``, composed with an act-order permutation), so
the weight needs no permutation in registers, and each dot reads a contiguous
``[2 BLOCK_KW, BLOCK_M]`` slice of the gathered x. The k order of a dot is free as long as x
and W agree; the two halves of a word are neighbours along K, which is how the MMA's register
layout pairs bf16 values, so the compiler loads the halves from the pipelined shared buffer
straight into the A-operand layout (``LDSM``) and unpacks them there.

**Dequantization in bf16, no float32 per weight.** A field ``q`` OR-ed into ``0x4300`` (the
bf16 bits of 128) and reinterpreted is ``128 + q`` exactly (an integer AND/OR instead of an
int-to-float conversion); subtracting 136 gives ``q - 8`` exactly, and a bf16 multiply-add with
the group's scale and zero gives ``(q - 8) * scale + zero``, the layout's definition. Compiled
for sm_90 that is, per pair of weights, one ``LOP3`` (plus a shift for nibbles 1-3), one
``HADD2.BF16_V2`` and one ``HFMA2.BF16_V2``. On CUDA the nibble is taken from both halves of a
32-bit register at once by a PTX shift and one ``lop3`` (``_nibble_magic``, ``UNPACK_ASM``);
the interpreter (no inline PTX) runs the plain Triton form, and a GPU test holds the two
bit-equal. Folding the 136 into the zero (``(128 + q) * s + (zero - 136 s)``) would save the
subtraction but is not exact in bf16: ``136 s`` has an ulp of about ``s``, so the folded zero
would be off by up to half a quantization step.

**What the sm_90 compilation shows** (Triton 3.6 compiles for ``GPUTarget("cuda", 90, 128)``
without a GPU; ``ptxas`` ships with it): the words and x go through ``cp.async`` into a
``num_stages`` ring; the dequantization stays in the wgmma A-operand registers as long as each
of its operands is loaded inside the loop or is a ``[BLOCK_N]`` vector broadcast along K (the
136 is therefore computed from the loaded halves, ``(v | c) & c``, which LLVM folds into an
immediate). A row's (scale, zero) pair is read as one 32-bit word: 16-bit loads are not
pipelined (``cp.async`` moves 4 bytes at least), and two such loads per row stalled every
iteration on a global-memory round trip. Triton waits for every register-A wgmma right after
issuing it (``WARPGROUP.DEPBAR.LE gsb0, 0x0``; with both operands in shared memory it keeps
one in flight), so a warpgroup alternates unpacking and MMA; the overlap comes from the other
warpgroup(s) of the program and from other programs on the SM, which is what ``num_warps``
and the tile sizes trade. Groups shorter than a K block (32 and 64 here) read one (scale,
zero) per word column (a word's 32 inputs never straddle a group) as a 2-D tile, which the
compiler dequantizes in its own layout and stages through shared memory: slower, still exact.

**Accumulation** in float32 in the MMA across all of K; the scales are applied to the weight
tile, never as per-tile corrections of the result. A bias is added in float32 before the one
rounding to bf16.

**Split-K** (``SPLIT_K > 1``): when output tiles are fewer than the SMs (the 8B ``o`` and
``down`` at 64 rows give 32 tiles of 128 outputs for 132 SMs), K is cut into ``SPLIT_K``
ranges; each program writes a float32 partial to a workspace and bumps a per-tile arrival
counter; the last to arrive sums the partials in index order (deterministic: the same sum
whatever the arrival order; the atomic only counts), writes y and resets the counter
(``linear.py``'s scheme and ``_SCRATCH`` workspace, so one launch, no memset, graph-capturable
after one eager call at the size). Results are bit-identical from call to call; they are not
batch-invariant (a row's result may change with the batch it is in), because the
configuration, and with it the K order and the split, depends on the number of rows.

**Configurations** (``_gemm_config``): ``TUNED`` maps (rows swept, N, K) to the sweep's choice
on the target GPU (``python -m engine_triton.quant_benchmark --int4-gemm-sweep``, which prints
the entries); a call takes its shape's entry for the smallest swept row count that covers it,
other shapes and larger row counts a rule of thumb. ``int4pack.GEMM_MAX_ROWS`` (512; 0: off) says up
to how many rows ``int4pack.linear`` sends layers here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine_triton.kernels._interpreter import interpreting
from engine_triton.kernels.linear import _SCRATCH, _sm_count
from engine_triton.kernels.pdl import pdl_launch, pdl_wait

# Unpack two weights per 32-bit register with one PTX shift and one lop3 (``_nibble_magic``)
# on CUDA; False (and always in the interpreter) unpacks each 16-bit half in Triton.
UNPACK_ASM = True
# The largest row block a program may own (its accumulator is BLOCK_N x BLOCK_M float32).
MAX_BLOCK_M = 256


class GemmConfig(NamedTuple):
    """A launch configuration: ``block_n`` outputs by ``block_m`` rows per program, K blocks
    of ``8 * block_kw`` inputs (``block_kw`` words of a row), K cut into ``split_k`` ranges."""

    block_n: int
    block_m: int
    block_kw: int
    split_k: int
    num_warps: int
    num_stages: int


# The sweep's choices: (rows, N, K) -> GemmConfig (block_n, block_m, block_kw, split_k,
# num_warps, num_stages) for the rows swept; a call of M rows takes the entry of the smallest
# swept row count >= M for its shape (``tuned_config``), so a sweep may add row counts between
# the powers of two. From ``quant_benchmark --int4-gemm-sweep --rows
# 32,64,128,256,512`` on an H100 80GB HBM3 (2026-12-07, docs/benchmarks.md), the Llama-3.1-8B
# projections qkv (6144 x 4096), o (4096 x 4096), gate_up (28672 x 4096) and down (4096 x 14336),
# at the row buckets where the GEMM beat dequantize + cuBLAS (other shapes: the rule of thumb).
TUNED: dict[tuple[int, int, int], GemmConfig] = {
    (32, 6144, 4096): GemmConfig(128, 32, 16, 4, 8, 3),
    (64, 6144, 4096): GemmConfig(128, 64, 16, 4, 8, 3),
    (128, 6144, 4096): GemmConfig(128, 128, 16, 2, 8, 4),
    (256, 6144, 4096): GemmConfig(128, 128, 16, 1, 8, 4),
    (32, 4096, 4096): GemmConfig(64, 32, 16, 4, 4, 4),
    (64, 4096, 4096): GemmConfig(64, 64, 16, 4, 4, 4),
    (128, 4096, 4096): GemmConfig(128, 64, 16, 2, 8, 4),
    (256, 4096, 4096): GemmConfig(128, 128, 16, 2, 8, 3),
    (32, 28672, 4096): GemmConfig(256, 32, 16, 1, 8, 3),
    (64, 28672, 4096): GemmConfig(256, 64, 16, 1, 8, 3),
    (128, 28672, 4096): GemmConfig(128, 128, 16, 1, 8, 3),
    (256, 28672, 4096): GemmConfig(128, 128, 16, 1, 8, 3),
    (512, 28672, 4096): GemmConfig(128, 128, 16, 1, 8, 3),
    (32, 4096, 14336): GemmConfig(128, 32, 16, 4, 8, 4),
    (64, 4096, 14336): GemmConfig(128, 64, 16, 8, 8, 3),
    (128, 4096, 14336): GemmConfig(128, 128, 16, 4, 8, 4),
    (256, 4096, 14336): GemmConfig(128, 128, 16, 2, 8, 3),
    (512, 4096, 14336): GemmConfig(128, 128, 16, 1, 8, 3),
}


@triton.jit
def _nibble_magic(halves, J: tl.constexpr, ASM: tl.constexpr):
    """Nibble ``J`` of every int16 half as the bf16 ``128 + q`` (``0x4300 | q``). With ``ASM``
    two halves share a 32-bit register (``pack=2``): ``(r >> 4 J) & 0x000F000F | 0x43004300``
    takes both in a shift and one lop3 (immLut 0xEA: ``(a & b) | c``); the bits shifted from
    the upper half into the lower are masked off. Triton's own 16-bit ops take about twice as
    many instructions (a PRMT to split the register, AND and OR each, a PRMT to join)."""
    if ASM:
        if J == 0:
            r = tl.inline_asm_elementwise(
                "lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xea;",
                "=r,r", [halves], dtype=tl.bfloat16, is_pure=True, pack=2,
            )  # fmt: skip
        elif J == 1:
            r = tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.u32 t, $1, 4; lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xea; }",
                "=r,r", [halves], dtype=tl.bfloat16, is_pure=True, pack=2,
            )  # fmt: skip
        elif J == 2:
            r = tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.u32 t, $1, 8; lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xea; }",
                "=r,r", [halves], dtype=tl.bfloat16, is_pure=True, pack=2,
            )  # fmt: skip
        else:
            r = tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.u32 t, $1, 12; lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xea; }",
                "=r,r", [halves], dtype=tl.bfloat16, is_pure=True, pack=2,
            )  # fmt: skip
    else:
        r = (((halves >> (4 * J)) & 0xF) | 0x4300).to(tl.bfloat16, bitcast=True)
    return r


@triton.jit(do_not_specialize=["M"])
def _int4_gemm_kernel(
    x_ptr,
    w16_ptr,
    sz32_ptr,
    bias_ptr,
    y_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    K_PER_SPLIT,
    LOG2_GROUP,
    stride_xm,
    stride_wn,
    stride_ym,
    INNER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_KW: tl.constexpr,
    SPLIT_K,
    IS_SPLIT: tl.constexpr,
    GROUP_PER_BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UNPACK_ASM: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """``y [M, N] = x_g [M, K] @ W^T (+ bias)`` with ``x_g`` = x gathered into ``x_order``
    (see the module docstring); one ``[BLOCK_N, BLOCK_M]`` tile of ``y^T`` over one K range.
    ``sz32_ptr`` is ``scale_zero`` read as int32 ``[K / group, N]`` (scale in the low half).
    The number of K ranges is a runtime argument (only whether K is split, ``IS_SPLIT``, is
    compiled in), so one compilation serves every split."""
    P: tl.constexpr = INNER // 2
    WT: tl.constexpr = 4 * P  # words of one row per k super-tile
    KT: tl.constexpr = 16 * INNER  # inputs per k super-tile
    BLOCK_K: tl.constexpr = 8 * BLOCK_KW  # inputs per iteration
    HW: tl.constexpr = 2 * BLOCK_KW  # 16-bit halves of the row's words per iteration
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)

    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    n_c = tl.minimum(n, N - 1)  # clamped, not masked: the loads stay unmasked
    # The words as int16 halves (``w16_ptr``): half h of word column c at 2 c + h.
    w_rows = w16_ptr + (2 * ((n_c // 8).to(tl.int64) * stride_wn + (n_c % 8) * WT))[:, None]
    hc = tl.arange(0, HW)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_c = tl.minimum(m, M - 1)
    x_cols = x_ptr + m_c.to(tl.int64)[None, :] * stride_xm + hc[:, None]  # x^T [HW, BLOCK_M]

    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(K, k_lo + K_PER_SPLIT)
    pdl_wait(USE_PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if BLOCK_KW % WT == 0:  # whole super-tiles: runs of 2 WT contiguous halves
            h_offs = (k0 // KT + hc // (2 * WT)) * (64 * P) + hc % (2 * WT)
        else:
            col = k0 // 8 + hc // 2  # the word column of each half
            h_offs = 2 * ((col // WT) * (32 * P) + col % WT) + hc % 2
        halves = tl.load(w_rows + h_offs[None, :])  # int16 [BLOCK_N, HW]
        # 136 in bf16 (0x4300 | 8) from the halves' own bits: (v | c) & c is c, but as a value
        # computed in the loop from the loaded tile, not a constant defined outside it, it
        # lets the compiler keep the whole dequantization in the MMA's register layout.
        c136 = ((halves | 0x4308) & 0x4308).to(tl.bfloat16, bitcast=True)
        # A row's (scale, zero) pair is one 32-bit load (scale in the low half): 16-bit loads
        # are not pipelined (cp.async moves 4 bytes at least) and stalled every iteration.
        if GROUP_PER_BLOCK:  # one group per K block: a scale and a zero per output row
            sz = tl.load(sz32_ptr + ((k0 >> LOG2_GROUP) * N + n_c))[:, None]
        else:  # one group per word (32 inputs, never across a group): per half
            col = k0 // 8 + hc // 2
            g = ((col // WT) * KT + 32 * (col % WT % P)) >> LOG2_GROUP
            sz = tl.load(sz32_ptr + (g[None, :] * N + n_c[:, None]))
        s = sz.to(tl.int16).to(tl.bfloat16, bitcast=True)
        z = (sz >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        for j in tl.static_range(4):
            # Field j of each half (field 4 h + j of its word) as 128 + q in bf16.
            w = (_nibble_magic(halves, j, UNPACK_ASM) - c136) * s + z  # (q - 8) * s + z
            xt = tl.load(x_cols + (k0 + j * HW))
            acc = tl.dot(w, xt, acc)

    if HAS_BIAS:  # added once, by whichever program stores y
        bias = tl.load(bias_ptr + n_c).to(tl.float32)[:, None]
    out_ok = n_ok[:, None] & (m < M)[None, :]
    y_offs = m.to(tl.int64)[None, :] * stride_ym + n[:, None]
    if IS_SPLIT:
        tile = pid_n * tl.num_programs(0) + pid_m
        part_offs = m.to(tl.int64)[None, :] * N + n[:, None]
        plane = tl.cast(M, tl.int64) * N  # one split's partials
        tl.store(part_ptr + pid_k * plane + part_offs, acc, mask=out_ok)
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next launch
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for i in range(SPLIT_K):  # in index order, whatever the arrival order
                total += tl.load(
                    part_ptr + i * plane + part_offs, mask=out_ok, other=0.0, cache_modifier=".cg"
                )
            if HAS_BIAS:
                total += bias
            tl.store(y_ptr + y_offs, total.to(y_ptr.dtype.element_ty), mask=out_ok)
    else:
        if HAS_BIAS:
            acc += bias
        tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=out_ok)


def supported(k: int, group_size: int) -> bool:
    """Whether the GEMM takes a layer of ``k`` inputs in groups of ``group_size``: K a
    multiple of 128 (one k super-tile of 8 k-tiles, the smallest K block the configurations
    use, so the layout's ``inner`` is 8), groups a power of two of 32 inputs or more (a word's
    32 inputs never straddle a group; the kernel finds a group by a shift)."""
    return k % 128 == 0 and group_size >= 32 and group_size & (group_size - 1) == 0


_ORDERS: dict[tuple, torch.Tensor] = {}


def x_order(k: int, inner: int, block_kw: int) -> torch.Tensor:
    """``[K]`` int64: the input feature at each position of the gathered x. K block ``k0``
    (``8 BLOCK_KW`` inputs) is four runs of ``2 BLOCK_KW``, one per nibble ``j`` of a 16-bit
    half; position ``2 i + h`` of run ``j`` holds the input that field ``4 h + j`` of the row's
    word column ``k0 / 8 + i`` carries."""
    p_words = inner // 2
    pos = torch.arange(k)
    k0, rest = pos // (8 * block_kw), pos % (8 * block_kw)
    j, hc = rest // (2 * block_kw), rest % (2 * block_kw)
    i, h = hc // 2, hc % 2
    f = 4 * h + j
    col = k0 * block_kw + i
    ko, wi = col // (4 * p_words), col % (4 * p_words)
    c, p = wi // p_words, wi % p_words
    return 16 * inner * ko + 32 * p + 8 * (f % 4) + 2 * c + f // 4


def _order(k: int, inner: int, block_kw: int, device: torch.device) -> torch.Tensor:
    key = (k, inner, block_kw, device)
    order = _ORDERS.get(key)
    if order is None:
        order = x_order(k, inner, block_kw).to(device)
        _ORDERS[key] = order
    return order


def block_rows(m: int, cap: int) -> int:
    """Rows per block: the power of two from 16 that covers ``m``, at most ``cap``."""
    block_m = 16
    while block_m < min(m, cap, MAX_BLOCK_M):
        block_m *= 2
    return block_m


def tuned_config(m: int, n: int, k: int) -> GemmConfig | None:
    """The ``TUNED`` entry of this shape for the smallest swept row count that covers ``m``
    rows, or None where the shape has none that large (the rule of thumb then)."""
    rows = [r for (r, tn, tk) in TUNED if tn == n and tk == k and r >= m]
    return TUNED[(min(rows), n, k)] if rows else None


def split_k(
    m: int, n: int, k: int, block_n: int, block_m: int, block_kw: int, sms: int, waves: int = 1
) -> int:
    """K ranges per output tile: doubled (up to 8) while the programs still fit in ``waves``
    waves of ``sms`` (more than one where several programs fit on an SM) and each range keeps
    at least 1,024 inputs and 4 K blocks."""
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    blocks = k // (8 * block_kw)
    least = max(4, 1024 // (8 * block_kw))
    split = 1
    while split < 8 and tiles * split * 2 <= sms * waves and blocks // (split * 2) >= least:
        split *= 2
    return split


def _gemm_config(m: int, n: int, k: int, sms: int) -> GemmConfig:
    """The sweep's choice for this shape where ``TUNED`` has one, else a rule of thumb: 128
    outputs by row blocks of up to 128 (one block at <= 128 rows, so every weight is unpacked
    once), K blocks of 128 (one group of 128 per block: the fast scale path for AWQ/GPTQ), K
    split to fill one wave of the SMs, four stages where the row block leaves shared memory
    for them (x^T is most of a stage: 16 KiB at 64 rows against 8 KiB of words)."""
    tuned = tuned_config(m, n, k)
    if tuned is not None:
        return tuned
    block_n, block_m, block_kw = 128, block_rows(m, 128), 16
    split = split_k(m, n, k, block_n, block_m, block_kw, sms)
    return GemmConfig(block_n, block_m, block_kw, split, 8, 4 if block_m <= 64 else 3)


def gemm(
    x: torch.Tensor,
    words: torch.Tensor,
    scale_zero: torch.Tensor,
    group_size: int,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W^T (+ bias)`` (bf16) for a weight in torch's int4 tile layout
    (``words``, ``scale_zero`` as ``int4pack.pack`` makes them); ``x`` in the checkpoint's
    input order, ``perm`` an act-order permutation (``x[:, perm]`` meets the packed columns)."""
    m, k = x.shape
    n = scale_zero.shape[1]
    inner = 2 * words.shape[-1]
    if not supported(k, group_size):
        raise ValueError(f"int4 GEMM: K={k} / group {group_size} not supported")
    block_n, block_m, block_kw, split, warps, stages = _gemm_config(m, n, k, _sm_count(x.device))
    while k % (8 * block_kw) and block_kw > 16:  # a configured K block longer than K allows
        block_kw //= 2
    block_k = 8 * block_kw
    if k % block_k:
        raise ValueError(f"int4 GEMM: K={k} is not a multiple of its K block {block_k}")
    order = _order(k, inner, block_kw, x.device)
    if perm is not None:
        order = perm.to(torch.int64).index_select(0, order)
    xg = x.index_select(1, order)
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    grid_m, grid_n = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    blocks = k // block_k
    split = max(1, min(split, blocks))
    k_per_split = triton.cdiv(blocks, split) * block_k
    if split > 1:
        part, counters = _SCRATCH.get(x.device, split * m * n, grid_m * grid_n)
    else:
        part, counters = y, y  # unused
    # A K block spans inputs k0 .. k0 + BLOCK_K only when it holds whole super-tiles (half a
    # super-tile's words carry inputs from all of it): one group per block iff the group is a
    # multiple of both.
    group_per_block = group_size % max(block_k, 16 * inner) == 0
    sz32 = scale_zero.view(torch.int32)  # [K / group, N, 1]: (scale, zero) as one word
    _int4_gemm_kernel[(grid_m, grid_n, split)](
        xg, words.view(torch.int16), sz32, bias if bias is not None else y, y, part, counters,
        m, n, k, k_per_split, group_size.bit_length() - 1, xg.stride(0), words.stride(0),
        y.stride(0),
        INNER=inner, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_KW=block_kw, SPLIT_K=split,
        IS_SPLIT=split > 1, GROUP_PER_BLOCK=group_per_block, HAS_BIAS=bias is not None,
        UNPACK_ASM=UNPACK_ASM and not interpreting(),
        num_warps=warps, num_stages=stages,
        **pdl_launch(x.device),
    )  # fmt: skip
    return y
