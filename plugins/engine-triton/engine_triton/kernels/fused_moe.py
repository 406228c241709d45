"""Mixture-of-experts kernels: softmax top-k routing and the routed experts' SwiGLU MLPs.

``moe_topk_softmax``: one program per token holds the token's E router logits in registers,
takes the float32 softmax, picks the top k by k rounds of max/argmax (ties to the lower index)
and renormalises when asked: one launch per layer instead of torch's softmax, topk, sum and
divide.

``fused_moe`` runs the experts one of two ways, chosen from the number of (token, choice)
pairs P = T * top_k (``use_decode``):

* **decode** (few pairs; always at batch 1): no sorting at all, two launches.
  ``_decode_gate_up``: grid (P, I / BLOCK_N); each program streams BLOCK_N gate rows and the
  matching BLOCK_N up rows of its pair's expert against the token's hidden vector (a GEMV:
  float32 FMA accumulators of [BLOCK_N, BLOCK_K], reduced once after the loop), applies
  SiLU-and-mul and writes the pair's slice of the intermediate ``[P, I]``.
  ``_decode_down``: grid (P, H / BLOCK_N); each program streams BLOCK_N rows of its pair's
  expert's down projection against the pair's intermediate vector and scales by the routing
  weight; the top-k sum happens in the same launch: each program leaves its float32 partial in
  a workspace and the last of a token's K programs to arrive at a counter adds them in choice
  order (deterministic) and writes the output, as the skinny linear's split-K does. The split
  over (pairs x intermediate blocks) and (pairs x hidden blocks) gives the Qwen3-30B-A3B shape
  at batch 1 384 and 2048 programs, enough bytes in flight to keep every SM of an H200
  streaming. Each pair reads its expert's weights once, so a batch whose tokens
  share experts reads those twice: ``use_decode`` sends a batch here only while the expected
  re-reads stay under 15% (60% for 4-bit experts, whose grouped GEMMs unpack in their K loop).
* **grouped** (everything else): the pairs are grouped by expert (``moe_align``: a count with
  atomics that also gives each pair its rank within its expert, then a scatter of the pair ids
  into per-expert runs padded to BLOCK_M), and two grouped GEMMs run over blocks of BLOCK_M
  pairs of one expert on the tensor cores: gate/up with SiLU-and-mul fused into the epilogue,
  then down with the routing weight applied in the epilogue, writing each pair's weighted
  output; a last kernel sums the top-k per token in float32. Every program recomputes the
  per-expert offsets from the E counts (a cumulative sum over E lanes), so no block-to-expert
  table is materialised. Grids are sized for the worst case padding (no host sync: the whole
  path can be captured in a CUDA graph); blocks past the padded total exit at once.

``fused_moe_fp8`` runs FP8 (e4m3) experts through the same kernels, **weight-only** (the
activations stay in their dtype; no W8A8): a ``SCALE`` constexpr (0 for unquantized experts,
which compile exactly as before) makes them load one byte per weight and scale in registers,
per output channel (1: the decode GEMV's row sums, the grouped GEMM's columns after the K loop)
or per ``(bn, bk)`` block (2: each K step, cut to divide bk so it lies in one block column; the
grouped GEMMs convert the e4m3 tile to the activation dtype, exactly, for the tensor cores).

``fused_moe_wna16`` runs 4/8-bit integer experts in groups (GPTQ, AWQ, compressed-tensors
W4A16/W8A16; weight-only) through the same four kernels: ``WBITS`` (0 otherwise, and then
every integer branch is pruned at compile time: the bf16 and FP8 kernels compile exactly as
before, their extra pointer arguments being ``None`` constexprs) makes them load the packed
int32 words (``32 / WBITS`` values along K, lowest bits first) and unpack them in registers
with ``engine_triton.kernels.wna16_linear``'s bit tricks rather than an integer-to-float
conversion per weight (a quarter of the integer rate on Hopper). Zero points (``HAS_ZP``; else
``2**(WBITS-1)``) and scales are folded in per group and output feature through the
activations' sum: ``sum_k x_k (q_k - z) s = s (sum_k x_k q_k - z sum_k x_k)``.

* decode GEMVs: a K step loads ``[BLOCK_N, BLOCK_K / PACK]`` words (vector loads), and per
  field ``j`` of the word the float ``1 + q / 2**WBITS`` (a shift and an AND-OR) multiplies the
  activations ``k = word * PACK + j``, gathered with that stride; the step's partial sums are
  scaled per word column, whose group is looked up (a step may span groups).
* grouped GEMMs: the words tile ``[BLOCK_K / PACK, BLOCK_N]`` is unpacked to the
  ``[BLOCK_K, BLOCK_N]`` operand as ``MAGIC + q`` in the activation dtype (the integer OR-ed
  into the mantissa of 128 for bf16, 1024 for fp16; converted for 8-bit bf16), and each K step
  lies inside one group (the step cut to divide the group, as FP8 block scales cut it) so its
  product is corrected and scaled once per column. Float32 activations (no tensor cores)
  multiply the dequantized float32 tile instead.
* act-order experts (``HAS_PERM``): the activations are read through the expert's
  permutation (a gathered load per step; the weights stream as before).

One group per row is the group ``next_power_of_2(K)``: every step's group is 0.

GGUF experts (``engine.quantization.gguf_moe`` on a GPU) come as the same words with float32
offsets in the zero points' place (``OFFSETS``: ``W = q s + o``, folded in as ``s x.q + o
sum(x)``), and their down projection may have its own width (a Q4_K_M file: 4-bit gate/up,
Q6_K down held in bytes): ``WBITS`` and ``MAGIC`` are per launch.

``fused_moe_biased`` (GPT-OSS's experts: per-expert biases and a choice of activation) runs
through the same four kernels too, with two more switches, both off by default (the other
ops' kernels compile exactly as before; the bias pointers and the activation's parameters are
``None`` constexprs there):

* ``HAS_BIAS``: the gate/up kernels add the expert's ``w13_bias`` row ``[2I]`` to the float32
  gate and up sums before they are rounded and activated; the down kernels add its ``w2_bias``
  row ``[H]`` to the float32 output before it is rounded and multiplied by the routing weight
  (the bias is part of the expert, so it is weighted with it).
* ``ACTIVATION``: ``ACT_SILU`` (SiLU-and-mul) or ``ACT_SWIGLUOAI``, GPT-OSS's clamped SwiGLU
  ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``,
  ``alpha`` and ``limit`` runtime floats (one compiled kernel for any values).

Its grouped path keeps each weighted expert output in float32 until the top-k sum (a float32
``pair_out``), as its reference specifies, rather than rounding it first as ``fused_moe``'s
does; the decode path's top-k sum is float32 for every op.

``fused_moe_mxfp4`` (GPT-OSS's experts as released: MXFP4 weights, two E2M1 codes a byte with
the low nibble the even input feature, one E8M0 exponent byte per 32 features; biases and the
activation as ``fused_moe_biased``'s, through the same ``ExpertEpilogue`` and float32
``pair_out``) runs through the same four kernels with one more switch, ``MXFP4`` (off: every
MXFP4 branch is pruned and the other ops' kernels compile exactly as before). The codes are
decoded with integer ops into float32 bit patterns, the block's exponent folded into the
exponent field (``_e2m1_to_f32``: exact, no table, no conversion), never dequantized to memory.
The decode GEMVs load a K step's bytes ``[BLOCK_N, BLOCK_K / 32, 16]`` (block, byte) and one
exponent per block, and multiply the low nibbles by the activations at even features and the
high nibbles by those at odd ones (``_mxfp4_gemv_step``); the grouped GEMMs decode
``[BLOCK_K / 32, 16, 2, BLOCK_N]`` (block, byte, nibble, column), convert it to the
activation dtype (exact for bfloat16) and reshape it to the tensor-core operand
(``_mxfp4_dot_step``). K steps are multiples of 32 and may span blocks. ``use_decode`` takes
the 4-bit rule; the tilings are ``MXFP4_DECODE`` and the general grouped rule's, chosen from
sm_90 compiles (register use, spills) and not yet timed on a GPU. The op is **not registered**
for cuda/rocm yet (see the note above ``fused_moe_mxfp4``): registering it moves GPT-OSS on
GPUs from experts dequantized at load to experts kept in MXFP4 (gpt-oss-120b's: 61 GB instead
of 229 GB in bfloat16), which should wait until the kernels have run on a GPU.

Ids of -1 (choices held by another expert-parallel rank) are skipped everywhere. Arithmetic is
float32; the gate/up results are rounded to the activation dtype before SiLU-and-mul and each
expert's down result before it is weighted, as the torch reference does; the grouped path of
``fused_moe`` (and its FP8 and integer forms) also stores each weighted expert output in the
activation dtype before the top-k sum (within one rounding of the reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels import reference as ref
from engine.kernels.quantized import MXFP4_BLOCK
from engine_triton.kernels.linear import _Scratch
from engine_triton.kernels.pdl import pdl_launch, pdl_wait
from engine_triton.kernels.wna16_linear import ONE_BITS, _dot_operand, _magic, _unit_field

MAX_ROUTER_EXPERTS = 1024  # register-resident softmax; more experts take the torch reference
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The kernels' ACTIVATION switch: SiLU-and-mul (every op) or GPT-OSS's clamped SwiGLU
# (``fused_moe_biased``'s "swigluoai").
ACT_SILU = tl.constexpr(0)
ACT_SWIGLUOAI = tl.constexpr(1)
ACTIVATIONS = {"silu": 0, "swigluoai": 1}


# ---- routing ----------------------------------------------------------------------------------
@triton.jit
def _topk_softmax_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    E,
    stride_t,
    TOP_K: tl.constexpr,
    K_POW2: tl.constexpr,
    E_POW2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, E_POW2)
    valid = lanes < E
    x = tl.load(logits_ptr + t * stride_t + lanes, mask=valid, other=-float("inf"))
    x = x.to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(valid, p, 0.0)
    p = p / tl.sum(p, 0)
    candidates = tl.where(valid, p, -1.0)
    kk = tl.arange(0, K_POW2)
    values = tl.zeros([K_POW2], dtype=tl.float32)
    chosen = tl.zeros([K_POW2], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(candidates, 0)
        index = tl.min(tl.where(candidates == best, lanes, E_POW2), 0)
        values = tl.where(kk == k, best, values)
        chosen = tl.where(kk == k, index, chosen)
        candidates = tl.where(lanes == index, -2.0, candidates)
    if RENORMALIZE:
        values = values / tl.sum(values, 0)  # lanes past TOP_K hold 0
    out = kk < TOP_K
    tl.store(weights_ptr + t * TOP_K + kk, values, mask=out)
    tl.store(ids_ptr + t * TOP_K + kk, chosen, mask=out)


def moe_topk_softmax(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``engine.kernels.reference.moe_topk_softmax``: [T, E] logits -> (float32 [T, K]
    weights, int32 [T, K] ids), in descending weight order."""
    t, e = router_logits.shape
    if e > MAX_ROUTER_EXPERTS or not 1 <= top_k <= e:
        return ref.moe_topk_softmax(router_logits, top_k, renormalize)
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    if t == 0:
        return weights, ids
    e_pow2 = triton.next_power_of_2(e)
    _topk_softmax_kernel[(t,)](
        logits,
        weights,
        ids,
        e,
        logits.stride(0),
        TOP_K=top_k,
        K_POW2=triton.next_power_of_2(top_k),
        E_POW2=e_pow2,
        RENORMALIZE=bool(renormalize),
        num_warps=1 if e_pow2 <= 256 else 4,
        **pdl_launch(logits.device),
    )
    return weights, ids


# ---- configurations ---------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode (GEMV) kernels: output rows per program and the K chunk
    of the gate/up kernel (``*_n``, ``*_k``) and of the down kernel."""

    gate_up_n: int = 16
    gate_up_k: int = 256
    down_n: int = 8
    down_k: int = 256
    num_warps: int = 4
    num_stages: int = 3

    def short(self) -> str:
        return (
            f"decode gu n{self.gate_up_n} k{self.gate_up_k} | down n{self.down_n} "
            f"k{self.down_k} w{self.num_warps} s{self.num_stages}"
        )


@dataclass(frozen=True)
class GroupedConfig:
    """Launch parameters of the grouped GEMMs (``block_m`` pairs of one expert per block).
    ``block_n`` output columns per program for the down GEMM, ``gate_up_n`` (default the
    same) for gate/up, which holds two accumulators (gate and up) of that width."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    gate_up_n: int | None = None

    @property
    def gate_up_block_n(self) -> int:
        return self.gate_up_n or self.block_n

    def short(self) -> str:
        gu = f"/{self.gate_up_n}" if self.gate_up_n else ""
        return (
            f"grouped m{self.block_m} n{self.block_n}{gu} k{self.block_k} g{self.group_m} "
            f"w{self.num_warps} s{self.num_stages}"
        )


def expected_distinct_experts(num_pairs: int, num_experts: int) -> float:
    """How many distinct experts ``num_pairs`` uniformly routed choices hit on average."""
    return num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** num_pairs)


DECODE_MAX_PAIRS = 64
DECODE_MAX_REREAD = 1.15
# 4-bit experts unpack their words inside the grouped GEMMs' K loop, which costs more than the
# decode GEMVs' re-reads: on an H100 (`tests/gpu/run_all.sh moe-kernels-wna16`, 2026-12-07)
# decode still won at 1.52x expected re-reads (Mixtral, 4 tokens: 777 vs 839 us a layer) and
# lost at 2.34x (8 tokens: 1,502 vs 904 us).
WNA16_DECODE_MAX_REREAD = 1.6


def use_decode(num_tokens: int, top_k: int, num_experts: int, bits: int = 0) -> bool:
    """Whether the decode kernels serve this batch: at batch 1 always; otherwise while the
    pairs would re-read at most 15% more expert weights than the grouped path (uniform
    routing; 60% for 4-bit experts, ``bits``), up to 64 pairs. Qwen3-30B-A3B (128 experts,
    top-8): up to 4 tokens (8 with 4-bit experts); Mixtral (8 experts, top-2): 1 token (4)."""
    pairs = num_tokens * top_k
    if num_tokens <= 1:
        return True
    if pairs > DECODE_MAX_PAIRS:
        return False
    reread = WNA16_DECODE_MAX_REREAD if bits == 4 else DECODE_MAX_REREAD
    return pairs <= reread * expected_distinct_experts(pairs, num_experts)


def grouped_config(num_pairs: int, num_experts: int, bits: int = 0) -> GroupedConfig:
    """Rule of thumb for the grouped GEMMs from the average pairs per expert: 16-row blocks
    while most of a block would be padding (decode batches), 64 rows for mixed steps, 128 for
    prefill. Three configurations only, so that the decode graphs, the warm-up and the
    profiling run compile all of them before any timed step.

    4-bit experts (``bits=4``) take their own three: 128 output columns and four pipeline
    stages throughout, 64 rows past 16 pairs per expert. Against the general rule they were
    1.13-1.43x faster at every grouped batch of the H100 sweep (Qwen3-30B-A3B, 32 tokens: 383
    vs 523 us a layer; 2,048 tokens: 1,497 vs 1,738 us); 8-bit experts were not swept and keep
    the general rule."""
    avg = num_pairs / num_experts
    if bits == 4:
        if avg <= 16:
            return GroupedConfig(16, 128, 128, 1, 4, 4)
        if avg <= 128:
            return GroupedConfig(64, 128, 64, 8, 4, 4)
        return GroupedConfig(64, 128, 64, 8, 4, 4, gate_up_n=64)  # 2 x 64x64 accumulators
    if avg <= 16:
        return GroupedConfig(16, 64, 128, 1, 4, 3)
    if avg <= 128:
        return GroupedConfig(64, 64, 64, 8, 4, 3)
    return GroupedConfig(128, 128, 64, 8, 8, 3, gate_up_n=64)  # 2 x 128x64 accumulators


# ---- FP8 expert scales -------------------------------------------------------------------------
@triton.jit
def _w13_scale_rows(
    s_ptr, expert, cols, INTER, stride_se, stride_sn,
    SCALE: tl.constexpr, SCALE_BN: tl.constexpr,
):  # fmt: skip
    """Pointers to the scales of gate rows ``cols`` and of the matching up rows: the scale
    itself per channel (SCALE 1: ``[E, 2I]``), the first of its block row per block (SCALE
    2: ``[E, 2 * ceil(I / bn), ceil(H / bk)]``, the gate's block rows then the up's; add the
    block column). Unused (and dead code) without scales."""
    base = s_ptr + expert.to(tl.int64) * stride_se
    if SCALE == 2:
        gate = base + (cols // SCALE_BN) * stride_sn
        up = base + (tl.cdiv(INTER, SCALE_BN) + cols // SCALE_BN) * stride_sn
    else:
        gate = base + cols * stride_sn
        up = base + (cols + INTER) * stride_sn
    return gate, up


@triton.jit
def _w2_scale_rows(
    s_ptr, expert, rows, stride_se, stride_sn, SCALE: tl.constexpr, SCALE_BN: tl.constexpr
):
    """As ``_w13_scale_rows`` for the down projection's rows (``[E, H]`` per channel,
    ``[E, ceil(H / bn), ceil(I / bk)]`` per block)."""
    base = s_ptr + expert.to(tl.int64) * stride_se
    if SCALE == 2:
        return base + (rows // SCALE_BN) * stride_sn
    return base + rows * stride_sn


# ---- integer expert weights -------------------------------------------------------------------
@triton.jit
def _int_gemv_step(
    x_row, p_row, w_rows, s_rows, z_rows, k0, K, one_bits,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, WBITS: tl.constexpr,
    GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_PERM: tl.constexpr,
    OFFSETS: tl.constexpr = False,
):  # fmt: skip
    """One K step ``[k0, k0 + BLOCK_K)`` of an integer decode GEMV: ``sum (q - z) s x`` of the
    ``BLOCK_N`` packed rows at ``w_rows`` (their scale / zero-point rows at ``s_rows`` /
    ``z_rows``, ``GROUP`` input features a group) against the activations ``x_row`` (read
    through the permutation row ``p_row`` with ``HAS_PERM``), per word column
    ``[BLOCK_N, BLOCK_K / PACK]`` in float32 (the caller sums them after its loop).

    The words load once, vectorized; field ``j`` of every word becomes ``1 + q / 2**WBITS``
    (``_unit_field``: a shift and an AND-OR) and one FMA accumulates it against the
    activations ``k = word * PACK + j`` (a strided gather of a vector L1 holds). Per word
    column, whose ``PACK`` features share one group: ``sum x (q - z) = 2**WBITS sum(x v) -
    (2**WBITS + z) sum(x)``, then the scale. With ``OFFSETS`` the ``z_rows`` hold float
    offsets ``o`` (``W = q s + o``): ``s (2**WBITS sum(x v) - 2**WBITS sum(x)) + o sum(x)``."""
    PACK: tl.constexpr = 32 // WBITS
    R: tl.constexpr = BLOCK_K // PACK
    ONE: tl.constexpr = 1 << WBITS
    r = tl.arange(0, R)
    words_at = k0 // PACK + r
    if EVEN_K:
        words = tl.load(w_rows + words_at[None, :])
    else:
        w_ok = words_at < K // PACK
        words = tl.load(w_rows + words_at[None, :], mask=w_ok[None, :], other=0)
    part = tl.zeros((BLOCK_N, R), dtype=tl.float32)
    xs = tl.zeros((R,), dtype=tl.float32)
    for j in tl.static_range(PACK):
        k = k0 + r * PACK + j
        if EVEN_K:
            if HAS_PERM:
                k = tl.load(p_row + k)
            xj = tl.load(x_row + k).to(tl.float32)
        else:
            k_ok = k < K
            if HAS_PERM:
                k = tl.load(p_row + k, mask=k_ok, other=0)
            xj = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        part += _unit_field(words, j, WBITS, one_bits) * xj[None, :]
        xs += xj
    group = ((k0 + r * PACK) // GROUP)[None, :]
    if EVEN_K:
        s = tl.load(s_rows[:, None] + group).to(tl.float32)
    else:
        s = tl.load(s_rows[:, None] + group, mask=w_ok[None, :], other=0.0).to(tl.float32)
    if HAS_ZP:
        if EVEN_K:
            z = tl.load(z_rows[:, None] + group).to(tl.float32)
        else:
            z = tl.load(z_rows[:, None] + group, mask=w_ok[None, :], other=0).to(tl.float32)
        if OFFSETS:
            return s * (part * ONE - ONE * xs[None, :]) + z * xs[None, :]
        return s * (part * ONE - (z + ONE) * xs[None, :])
    return s * (part * ONE - (ONE + (1 << (WBITS - 1))) * xs[None, :])


@triton.jit
def _int_dot_step(
    acc, x, w_cols, s_cols, z_cols, k0, K,
    EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, WBITS: tl.constexpr,
    HAS_ZP: tl.constexpr, MAGIC: tl.constexpr, PRECISION: tl.constexpr,
    OFFSETS: tl.constexpr = False,
):  # fmt: skip
    """``acc`` plus one grouped K step: the activations ``x`` ``[BLOCK_M, BLOCK_K]`` (input
    features ``[k0, k0 + BLOCK_K)``, inside one group) times the packed rows ``w_cols``
    (``[BLOCK_N]`` pointers, K contiguous), whose scale / zero-point rows are ``s_cols`` /
    ``z_cols``.

    16-bit activations: the words ``[BLOCK_K / PACK, BLOCK_N]`` load once and unpack to
    ``[BLOCK_K / PACK, PACK, BLOCK_N]`` (the feature order ``word * PACK + field``), the
    tensor-core operand being ``MAGIC + q`` in x's dtype (``wna16_linear._dot_operand``);
    the float32 product is then corrected and scaled per column, ``s (x . (MAGIC + q) -
    (MAGIC + z) sum x)``. Float32 activations (an FMA product, no tensor cores) multiply the
    dequantized float32 tile ``(q - z) s`` into ``acc`` instead, each feature loading its
    word (L1 serves the repeats): the unpack's reshape into the FMA operand's layout, and the
    correction, spilled to local memory (sm_90 compile).

    ``OFFSETS``: ``z_cols`` hold float offsets ``o`` (``W = q s + o``, GGUF's form), so the
    step adds ``s (x . (MAGIC + q) - MAGIC sum x) + o sum x`` (float32: ``x . (q s + o)``)."""
    PACK: tl.constexpr = 32 // WBITS
    R: tl.constexpr = BLOCK_K // PACK
    kb = k0 // GROUP
    s = tl.load(s_cols + kb).to(tl.float32)
    if HAS_ZP:
        z = tl.load(z_cols + kb).to(tl.float32)
    else:
        z = tl.zeros_like(s) + (1 << (WBITS - 1))
    if x.dtype == tl.float32:
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            words = tl.load(w_cols[None, :] + (k // PACK)[:, None])
        else:
            words = tl.load(w_cols[None, :] + (k // PACK)[:, None], mask=(k < K)[:, None], other=0)
        q = ((words >> ((k % PACK) * WBITS)[:, None]) & ((1 << WBITS) - 1)).to(tl.float32)
        if OFFSETS:
            return tl.dot(x, q * s[None, :] + z[None, :], acc, input_precision=PRECISION)
        return tl.dot(x, (q - z[None, :]) * s[None, :], acc, input_precision=PRECISION)
    words_at = k0 // PACK + tl.arange(0, R)
    if EVEN_K:
        words = tl.load(w_cols[None, :] + words_at[:, None])
    else:
        w_ok = words_at < K // PACK
        words = tl.load(w_cols[None, :] + words_at[:, None], mask=w_ok[:, None], other=0)
    shifts = tl.arange(0, PACK) * WBITS
    q = (words[:, None, :] >> shifts[None, :, None]) & ((1 << WBITS) - 1)
    w = _dot_operand(tl.reshape(q, (BLOCK_K, q.shape[2])), x, MAGIC)
    dq = tl.dot(x, w, input_precision=PRECISION)
    xsum = tl.sum(x.to(tl.float32), axis=1)
    if OFFSETS:
        return acc + s[None, :] * (dq - MAGIC * xsum[:, None]) + z[None, :] * xsum[:, None]
    return acc + s[None, :] * (dq - (z + MAGIC)[None, :] * xsum[:, None])


# ---- MXFP4 expert weights ----------------------------------------------------------------------
@triton.jit
def _e2m1_to_f32(code, scale):
    """E2M1 codes (int32 0..15: bit 3 the sign, then two exponent bits and one mantissa bit)
    times their block's E8M0 exponent ``2 ** (scale - 127)`` (int32), as float32, built from
    integer ops alone (no conversion, no table): ``mag = code & 7`` is 0 (zero), 1 (0.5: the
    bits ``(scale - 1) << 23``) or ``(1 + m / 2) * 2 ** (e - 1)`` with ``e = mag >> 1``, ``m =
    mag & 1`` (the bits ``((e + scale - 1) << 23) | (m << 22)``), and the sign goes to bit 31.
    Exact, as ``engine.kernels.quantized.dequantize_mxfp4_experts``'s float32 values, for
    every scale whose products are normal floats (2 to 252; checkpoints hold about 110 to
    130): no subnormals, no infinities."""
    mag = code & 7
    e = mag >> 1
    m = mag & 1
    normal = ((e + scale - 1) << 23) | (m << 22)
    bits = tl.where(mag >= 2, normal, tl.where(mag == 1, (scale - 1) << 23, 0))
    bits = bits | ((code >> 3) << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_gemv_step(x_row, w_rows, s_rows, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """One K step ``[k0, k0 + BLOCK_K)`` of an MXFP4 decode GEMV: the float32 products
    ``[BLOCK_N, BLOCK_K / 32, 16]`` (row, block of 32 features, byte of the block) of the rows
    at ``w_rows`` (``[BLOCK_N, 1]`` pointers to uint8 rows, two codes a byte along K, the low
    nibble the even feature) and their E8M0 exponents at ``s_rows`` (``[BLOCK_N]``, one per
    block) with the activations ``x_row``; the caller sums them after its loop. The bytes load
    once (16-byte vector loads) and each block's exponent once, broadcast over its 16 bytes in
    registers; the low nibbles multiply the activations at even features and the high nibbles
    those at odd ones (two FMAs against ``x`` gathered with stride 2, which L1 serves)."""
    G: tl.constexpr = BLOCK_K // 32
    g = k0 // 32 + tl.arange(0, G)  # MXFP4 blocks
    c = g[:, None] * 16 + tl.arange(0, 16)[None, :]  # bytes: features 2c (low), 2c + 1 (high)
    if EVEN_K:
        b = tl.load(w_rows[:, :, None] + c[None, :, :])
        s = tl.load(s_rows[:, None] + g[None, :])
        x_even = tl.load(x_row + 2 * c).to(tl.float32)
        x_odd = tl.load(x_row + 2 * c + 1).to(tl.float32)
    else:
        ok = g < K // 32
        b = tl.load(w_rows[:, :, None] + c[None, :, :], mask=ok[None, :, None], other=0)
        s = tl.load(s_rows[:, None] + g[None, :], mask=ok[None, :], other=127)
        x_even = tl.load(x_row + 2 * c, mask=ok[:, None], other=0.0).to(tl.float32)
        x_odd = tl.load(x_row + 2 * c + 1, mask=ok[:, None], other=0.0).to(tl.float32)
    b = b.to(tl.int32)
    s = s.to(tl.int32)[:, :, None]
    return _e2m1_to_f32(b & 15, s) * x_even[None] + _e2m1_to_f32(b >> 4, s) * x_odd[None]


@triton.jit
def _mxfp4_dot_step(
    acc, x, w_cols, s_cols, k0, K,
    EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """``acc`` plus one grouped K step: the activations ``x`` ``[BLOCK_M, BLOCK_K]`` (features
    ``[k0, k0 + BLOCK_K)``) times the MXFP4 rows ``w_cols`` (``[BLOCK_N]`` pointers to uint8
    rows, K contiguous), whose E8M0 exponent rows are ``s_cols``.

    The bytes load once as ``[BLOCK_K / 32, 16, BLOCK_N]`` (block, byte, column: 16-byte
    vector loads) and each block's exponent once (``[BLOCK_K / 32, BLOCK_N]``, broadcast over
    its bytes in registers); the two nibbles of each byte decode (``_e2m1_to_f32``, exponent
    folded in) to ``[BLOCK_K / 32, 16, 2, BLOCK_N]``, the feature order ``32 block + 2 byte +
    nibble``, converted to x's dtype (exact for bfloat16 and float32; float16 rounds as the
    reference's dequantization does) and reshaped to the ``[BLOCK_K, BLOCK_N]`` operand of
    one ``tl.dot``, as the integer experts' words are (``_int_dot_step``). Float32 activations
    take the same path (an FMA product, no tensor cores), which spills registers in an sm_90
    compile as the integer experts' float32 path does (GPT-OSS runs in bfloat16)."""
    G: tl.constexpr = BLOCK_K // 32
    g = k0 // 32 + tl.arange(0, G)
    r = g[:, None] * 16 + tl.arange(0, 16)[None, :]  # [G, 16] byte offsets in the rows
    b_ptrs = w_cols[None, None, :] + r[:, :, None]
    s_ptrs = s_cols[None, :] + g[:, None]
    if EVEN_K:
        b = tl.load(b_ptrs)
        s = tl.load(s_ptrs)
    else:
        ok = g < K // 32
        b = tl.load(b_ptrs, mask=ok[:, None, None], other=0)
        s = tl.load(s_ptrs, mask=ok[:, None], other=127)
    shifts = tl.arange(0, 2) * 4
    code = (b.to(tl.int32)[:, :, None, :] >> shifts[None, None, :, None]) & 15
    v = _e2m1_to_f32(code, s.to(tl.int32)[:, None, None, :]).to(x.dtype)
    w = tl.reshape(v, (BLOCK_K, v.shape[3]))
    return tl.dot(x, w, acc, input_precision=PRECISION)


# ---- decode kernels ---------------------------------------------------------------------------
@triton.jit
def _silu_mul(gate, up, out_dtype: tl.constexpr):
    """SiLU(gate) * up in float32 from gate/up rounded to the activation dtype, rounded."""
    g = gate.to(out_dtype).to(tl.float32)
    u = up.to(out_dtype).to(tl.float32)
    return (g / (1.0 + tl.exp(-g)) * u).to(out_dtype)


@triton.jit
def _swigluoai_mul(gate, up, out_dtype: tl.constexpr, alpha, limit):
    """GPT-OSS's clamped SwiGLU (``engine.kernels.reference.swigluoai_and_mul``): ``(u + 1) *
    g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
    in float32 from gate/up rounded to the activation dtype, rounded once. NaNs propagate
    through the clamps, as torch's ``clamp`` propagates them."""
    g = gate.to(out_dtype).to(tl.float32)
    u = up.to(out_dtype).to(tl.float32)
    g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
    u = tl.maximum(tl.minimum(u, limit, propagate_nan=tl.PropagateNan.ALL), -limit,
                   propagate_nan=tl.PropagateNan.ALL)  # fmt: skip
    return ((u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))).to(out_dtype)


@triton.jit(do_not_specialize=["num_pairs"])
def _decode_gate_up_kernel(
    x_ptr,
    w13_ptr,
    ids_ptr,
    inter_ptr,
    num_pairs,
    H,
    INTER,
    stride_xt,
    stride_we,
    stride_wn,
    s_ptr,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    SCALE: tl.constexpr = 0,
    SCALE_BN: tl.constexpr = 1,
    SCALE_BK: tl.constexpr = 1,
    WBITS: tl.constexpr = 0,
    HAS_ZP: tl.constexpr = False,
    HAS_PERM: tl.constexpr = False,
    OFFSETS: tl.constexpr = False,
    z_ptr=None,
    p_ptr=None,
    one_bits=None,
    HAS_BIAS: tl.constexpr = False,
    ACTIVATION: tl.constexpr = ACT_SILU,
    b_ptr=None,
    alpha=None,
    limit=None,
    MXFP4: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + pair)
    if expert < 0:
        return
    token = pair // TOP_K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_c = tl.minimum(cols, INTER - 1)  # clamped, so the weight loads need no mask
    w_base = w13_ptr + expert.to(tl.int64) * stride_we
    gate_rows = w_base + cols_c.to(tl.int64)[:, None] * stride_wn
    up_rows = w_base + (cols_c + INTER).to(tl.int64)[:, None] * stride_wn
    g_scales, u_scales = _w13_scale_rows(
        s_ptr, expert, cols_c, INTER, stride_se, stride_sn, SCALE, SCALE_BN
    )
    x_row = x_ptr + token.to(tl.int64) * stride_xt
    if MXFP4:  # MXFP4 experts: byte rows, E8M0 exponents [E, 2I, H / 32] (per-channel rows)
        acc_g = tl.zeros((BLOCK_N, BLOCK_K // 32, 16), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K // 32, 16), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            acc_g += _mxfp4_gemv_step(x_row, gate_rows, g_scales, k0, H, BLOCK_K, EVEN_K)
            acc_u += _mxfp4_gemv_step(x_row, up_rows, u_scales, k0, H, BLOCK_K, EVEN_K)
        gate = tl.sum(tl.sum(acc_g, axis=2), axis=1)
        up = tl.sum(tl.sum(acc_u, axis=2), axis=1)
    elif WBITS != 0:  # integer experts: packed rows, scales [E, 2I, groups] (SCALE 2, SCALE_BN 1)
        g_zeros = None
        u_zeros = None
        p_row = None
        if HAS_ZP:
            g_zeros, u_zeros = _w13_scale_rows(
                z_ptr, expert, cols_c, INTER, stride_se, stride_sn, SCALE, SCALE_BN
            )
        if HAS_PERM:
            p_row = p_ptr + expert.to(tl.int64) * H
        acc_g = tl.zeros((BLOCK_N, BLOCK_K // (32 // WBITS)), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K // (32 // WBITS)), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            acc_g += _int_gemv_step(
                x_row, p_row, gate_rows, g_scales, g_zeros, k0, H, one_bits,
                BLOCK_N, BLOCK_K, EVEN_K, WBITS, SCALE_BK, HAS_ZP, HAS_PERM, OFFSETS,
            )  # fmt: skip
            acc_u += _int_gemv_step(
                x_row, p_row, up_rows, u_scales, u_zeros, k0, H, one_bits,
                BLOCK_N, BLOCK_K, EVEN_K, WBITS, SCALE_BK, HAS_ZP, HAS_PERM, OFFSETS,
            )  # fmt: skip
        gate = tl.sum(acc_g, axis=1)
        up = tl.sum(acc_u, axis=1)
    else:
        kk = tl.arange(0, BLOCK_K)
        acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs = k0 + kk
            if EVEN_K:
                x = tl.load(x_row + offs).to(tl.float32)
                wg = tl.load(gate_rows + offs[None, :])
                wu = tl.load(up_rows + offs[None, :])
            else:
                k_ok = offs < H
                x = tl.load(x_row + offs, mask=k_ok, other=0.0).to(tl.float32)
                wg = tl.load(gate_rows + offs[None, :], mask=k_ok[None, :], other=0.0)
                wu = tl.load(up_rows + offs[None, :], mask=k_ok[None, :], other=0.0)
            if SCALE == 2:  # the K step lies in one block column (BLOCK_K divides SCALE_BK)
                kb = k0 // SCALE_BK
                acc_g += wg.to(tl.float32) * tl.load(g_scales + kb)[:, None] * x[None, :]
                acc_u += wu.to(tl.float32) * tl.load(u_scales + kb)[:, None] * x[None, :]
            else:
                acc_g += wg.to(tl.float32) * x[None, :]
                acc_u += wu.to(tl.float32) * x[None, :]
        gate = tl.sum(acc_g, axis=1)
        up = tl.sum(acc_u, axis=1)
        if SCALE == 1:
            gate = gate * tl.load(g_scales)
            up = up * tl.load(u_scales)
    if HAS_BIAS:  # the expert's gate/up biases, before the rounding and the activation
        b_row = b_ptr + expert.to(tl.int64) * (2 * INTER) + cols_c
        gate += tl.load(b_row).to(tl.float32)
        up += tl.load(b_row + INTER).to(tl.float32)
    if ACTIVATION == ACT_SWIGLUOAI:
        h = _swigluoai_mul(gate, up, inter_ptr.dtype.element_ty, alpha, limit)
    else:
        h = _silu_mul(gate, up, inter_ptr.dtype.element_ty)
    tl.store(inter_ptr + pair.to(tl.int64) * INTER + cols, h, mask=cols < INTER)


@triton.jit(do_not_specialize=["num_tokens"])
def _decode_down_kernel(
    inter_ptr,
    w2_ptr,
    ids_ptr,
    topk_w_ptr,
    out_ptr,
    ws_ptr,
    counter_ptr,
    num_tokens,
    H,
    INTER,
    stride_we,
    stride_wn,
    stride_ot,
    s_ptr,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    SCALE: tl.constexpr = 0,
    SCALE_BN: tl.constexpr = 1,
    SCALE_BK: tl.constexpr = 1,
    WBITS: tl.constexpr = 0,
    HAS_ZP: tl.constexpr = False,
    HAS_PERM: tl.constexpr = False,
    OFFSETS: tl.constexpr = False,
    z_ptr=None,
    p_ptr=None,
    one_bits=None,
    HAS_BIAS: tl.constexpr = False,
    b_ptr=None,
    MXFP4: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    token = pair // TOP_K
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_c = tl.minimum(rows, H - 1)
    row_ok = rows < H
    expert = tl.load(ids_ptr + pair)
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if expert >= 0:
        w_rows = w2_ptr + expert.to(tl.int64) * stride_we + rows_c.to(tl.int64)[:, None] * stride_wn
        scales = _w2_scale_rows(s_ptr, expert, rows_c, stride_se, stride_sn, SCALE, SCALE_BN)
        a_row = inter_ptr + pair.to(tl.int64) * INTER
        if MXFP4:  # MXFP4 experts (see the gate/up kernel)
            acc = tl.zeros((BLOCK_N, BLOCK_K // 32, 16), dtype=tl.float32)
            for k0 in range(0, INTER, BLOCK_K):
                acc += _mxfp4_gemv_step(a_row, w_rows, scales, k0, INTER, BLOCK_K, EVEN_K)
            y = tl.sum(tl.sum(acc, axis=2), axis=1)
        elif WBITS != 0:  # integer experts (see the gate/up kernel)
            zeros = None
            p_row = None
            if HAS_ZP:
                zeros = _w2_scale_rows(z_ptr, expert, rows_c, stride_se, stride_sn, SCALE, SCALE_BN)
            if HAS_PERM:
                p_row = p_ptr + expert.to(tl.int64) * INTER
            acc = tl.zeros((BLOCK_N, BLOCK_K // (32 // WBITS)), dtype=tl.float32)
            for k0 in range(0, INTER, BLOCK_K):
                acc += _int_gemv_step(
                    a_row, p_row, w_rows, scales, zeros, k0, INTER, one_bits,
                    BLOCK_N, BLOCK_K, EVEN_K, WBITS, SCALE_BK, HAS_ZP, HAS_PERM, OFFSETS,
                )  # fmt: skip
            y = tl.sum(acc, axis=1)
        else:
            kk = tl.arange(0, BLOCK_K)
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, INTER, BLOCK_K):
                offs = k0 + kk
                if EVEN_K:
                    a = tl.load(a_row + offs).to(tl.float32)
                    w = tl.load(w_rows + offs[None, :])
                else:
                    k_ok = offs < INTER
                    a = tl.load(a_row + offs, mask=k_ok, other=0.0).to(tl.float32)
                    w = tl.load(w_rows + offs[None, :], mask=k_ok[None, :], other=0.0)
                if SCALE == 2:
                    acc += w.to(tl.float32) * tl.load(scales + k0 // SCALE_BK)[:, None] * a[None, :]
                else:
                    acc += w.to(tl.float32) * a[None, :]
            y = tl.sum(acc, axis=1)
            if SCALE == 1:
                y = y * tl.load(scales)
        if HAS_BIAS:  # the expert's down bias: part of its output, so weighted with it
            y += tl.load(b_ptr + expert.to(tl.int64) * H + rows_c).to(tl.float32)
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = y * tl.load(topk_w_ptr + pair)
    # The top-k sum: every choice of the token leaves its weighted rows in the float32
    # workspace and arrives at the (token, row block) counter; the last to arrive adds the
    # K partials in choice order (deterministic), writes the output and re-zeroes the counter.
    tl.store(ws_ptr + pair.to(tl.int64) * H + rows, y, mask=row_ok)
    tl.debug_barrier()  # every warp's partial is stored before the (one-thread) arrival
    counter = counter_ptr + token * tl.num_programs(1) + pid_n
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    if arrived == TOP_K - 1:
        tl.atomic_xchg(counter, 0)
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            part = ws_ptr + (token * TOP_K + k).to(tl.int64) * H + rows
            total += tl.load(part, mask=row_ok, other=0.0, cache_modifier=".cg")
        out = out_ptr + token.to(tl.int64) * stride_ot + rows
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=row_ok)


# ---- grouped kernels --------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_pairs"])
def _align_count_kernel(ids_ptr, counts_ptr, rank_ptr, num_pairs, E, BLOCK: tl.constexpr):
    """counts[e] += 1 per pair; each pair's rank within its expert is the count it saw."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=in_range, other=-1)
    valid = in_range & (expert >= 0) & (expert < E)
    rank = tl.atomic_add(counts_ptr + tl.where(valid, expert, 0), 1, mask=valid)
    tl.store(rank_ptr + offs, rank, mask=valid)


@triton.jit
def _expert_offsets(counts_ptr, E, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """(lanes, counts, padded starts, padded ends) of every expert's run, from the counts."""
    lanes = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + lanes, mask=lanes < E, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    return lanes, counts, ends - padded, ends


@triton.jit(do_not_specialize=["num_pairs"])
def _align_scatter_kernel(
    ids_ptr,
    rank_ptr,
    counts_ptr,
    sorted_ptr,
    num_pairs,
    E,
    BLOCK_M: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """sorted[start(e) + rank] = pair: the pair ids in per-expert runs padded to BLOCK_M."""
    lanes, _, starts, _ = _expert_offsets(counts_ptr, E, BLOCK_M, E_POW2)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=in_range, other=-1)
    valid = in_range & (expert >= 0) & (expert < E)
    rank = tl.load(rank_ptr + offs, mask=valid, other=0)
    start = tl.sum(tl.where(expert[:, None] == lanes[None, :], starts[None, :], 0), axis=1)
    tl.store(sorted_ptr + start + rank, offs, mask=valid)


@triton.jit
def _grouped_block(
    pid, counts_ptr, sorted_ptr, E, num_n, max_m_blocks,
    BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """The (expert, pair ids, row mask, n block) a grouped-GEMM program works on; expert is
    -1 for programs past the padded total."""
    # Programs of GROUP_M consecutive M blocks sweep N together (weight tiles reused in L2).
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(max_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    lanes, counts, starts, ends = _expert_offsets(counts_ptr, E, BLOCK_M, E_POW2)
    block_start = pid_m * BLOCK_M
    expert = tl.sum((ends <= block_start).to(tl.int32), axis=0)
    start = tl.sum(tl.where(lanes == expert, starts, 0), axis=0)
    count = tl.sum(tl.where(lanes == expert, counts, 0), axis=0)
    rows = block_start - start + tl.arange(0, BLOCK_M)
    row_ok = (rows < count) & (expert < E)
    pairs = tl.load(sorted_ptr + block_start + tl.arange(0, BLOCK_M), mask=row_ok, other=0)
    expert = tl.where(expert < E, expert, -1)
    return expert, pairs, row_ok, pid_n


@triton.jit(do_not_specialize=["num_pairs", "max_m_blocks"])
def _grouped_gate_up_kernel(
    x_ptr,
    w13_ptr,
    counts_ptr,
    sorted_ptr,
    inter_ptr,
    num_pairs,
    max_m_blocks,
    H,
    INTER,
    E,
    stride_xt,
    stride_we,
    stride_wn,
    s_ptr,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_POW2: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    SCALE: tl.constexpr = 0,
    SCALE_BN: tl.constexpr = 1,
    SCALE_BK: tl.constexpr = 1,
    WBITS: tl.constexpr = 0,
    HAS_ZP: tl.constexpr = False,
    HAS_PERM: tl.constexpr = False,
    MAGIC: tl.constexpr = 0,
    OFFSETS: tl.constexpr = False,
    z_ptr=None,
    p_ptr=None,
    HAS_BIAS: tl.constexpr = False,
    ACTIVATION: tl.constexpr = ACT_SILU,
    b_ptr=None,
    alpha=None,
    limit=None,
    MXFP4: tl.constexpr = False,
):
    num_n = tl.cdiv(INTER, BLOCK_N)
    expert, pairs, row_ok, pid_n = _grouped_block(
        tl.program_id(0), counts_ptr, sorted_ptr, E, num_n, max_m_blocks,
        BLOCK_M, E_POW2, GROUP_M,
    )  # fmt: skip
    if expert < 0:
        return
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_c = tl.minimum(cols, INTER - 1)
    kk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + kk[None, :]
    w_base = w13_ptr + expert.to(tl.int64) * stride_we
    # [BLOCK_K, BLOCK_N] views of the gate and up rows (K contiguous in memory).
    g_ptrs = w_base + cols_c.to(tl.int64)[None, :] * stride_wn + kk[:, None]
    u_ptrs = w_base + (cols_c + INTER).to(tl.int64)[None, :] * stride_wn + kk[:, None]
    g_scales, u_scales = _w13_scale_rows(
        s_ptr, expert, cols_c, INTER, stride_se, stride_sn, SCALE, SCALE_BN
    )
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if MXFP4:  # MXFP4 experts: byte rows, per-channel exponent rows (any K step of 32s)
        g_cols = w_base + cols_c.to(tl.int64) * stride_wn
        u_cols = w_base + (cols_c + INTER).to(tl.int64) * stride_wn
        x_rows = x_ptr + tokens[:, None] * stride_xt
        for k0 in range(0, H, BLOCK_K):
            k = k0 + kk
            if EVEN_K:
                x = tl.load(x_rows + k[None, :], mask=row_ok[:, None], other=0.0)
            else:
                x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & (k < H)[None, :], other=0.0)
            acc_g = _mxfp4_dot_step(acc_g, x, g_cols, g_scales, k0, H, EVEN_K, BLOCK_K, PRECISION)
            acc_u = _mxfp4_dot_step(acc_u, x, u_cols, u_scales, k0, H, EVEN_K, BLOCK_K, PRECISION)
    elif WBITS != 0:  # integer experts: each K step inside one group (BLOCK_K divides SCALE_BK)
        g_cols = w_base + cols_c.to(tl.int64) * stride_wn
        u_cols = w_base + (cols_c + INTER).to(tl.int64) * stride_wn
        g_zeros = None
        u_zeros = None
        if HAS_ZP:
            g_zeros, u_zeros = _w13_scale_rows(
                z_ptr, expert, cols_c, INTER, stride_se, stride_sn, SCALE, SCALE_BN
            )
        x_rows = x_ptr + tokens[:, None] * stride_xt
        for k0 in range(0, H, BLOCK_K):
            k = k0 + kk
            k_ok = k < H
            if HAS_PERM:  # act-order: this expert's order of the input features
                k = tl.load(p_ptr + expert.to(tl.int64) * H + k, mask=k_ok, other=0)
            if EVEN_K:
                x = tl.load(x_rows + k[None, :], mask=row_ok[:, None], other=0.0)
            else:
                x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc_g = _int_dot_step(
                acc_g, x, g_cols, g_scales, g_zeros, k0, H,
                EVEN_K, BLOCK_K, SCALE_BK, WBITS, HAS_ZP, MAGIC, PRECISION, OFFSETS,
            )  # fmt: skip
            acc_u = _int_dot_step(
                acc_u, x, u_cols, u_scales, u_zeros, k0, H,
                EVEN_K, BLOCK_K, SCALE_BK, WBITS, HAS_ZP, MAGIC, PRECISION, OFFSETS,
            )  # fmt: skip
    else:
        for k0 in range(0, H, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
                wg = tl.load(g_ptrs)
                wu = tl.load(u_ptrs)
            else:
                k_ok = (k0 + kk) < H
                x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                wg = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
                wu = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
            if SCALE != 0:  # e4m3 values are exact in every activation dtype
                wg = wg.to(x.dtype)
                wu = wu.to(x.dtype)
            if SCALE == 2:  # the K step lies in one block column (BLOCK_K divides SCALE_BK)
                kb = k0 // SCALE_BK
                acc_g += tl.dot(x, wg, input_precision=PRECISION) * tl.load(g_scales + kb)[None, :]
                acc_u += tl.dot(x, wu, input_precision=PRECISION) * tl.load(u_scales + kb)[None, :]
            else:
                acc_g = tl.dot(x, wg, acc_g, input_precision=PRECISION)
                acc_u = tl.dot(x, wu, acc_u, input_precision=PRECISION)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
    if SCALE == 1:
        acc_g = acc_g * tl.load(g_scales)[None, :]
        acc_u = acc_u * tl.load(u_scales)[None, :]
    if HAS_BIAS:  # the expert's gate/up biases, before the rounding and the activation
        b_row = b_ptr + expert.to(tl.int64) * (2 * INTER) + cols_c
        acc_g += tl.load(b_row).to(tl.float32)[None, :]
        acc_u += tl.load(b_row + INTER).to(tl.float32)[None, :]
    if ACTIVATION == ACT_SWIGLUOAI:
        h = _swigluoai_mul(acc_g, acc_u, inter_ptr.dtype.element_ty, alpha, limit)
    else:
        h = _silu_mul(acc_g, acc_u, inter_ptr.dtype.element_ty)
    out = inter_ptr + pairs.to(tl.int64)[:, None] * INTER + cols[None, :]
    tl.store(out, h, mask=row_ok[:, None] & (cols < INTER)[None, :])


@triton.jit(do_not_specialize=["num_pairs", "max_m_blocks"])
def _grouped_down_kernel(
    inter_ptr,
    w2_ptr,
    counts_ptr,
    sorted_ptr,
    topk_w_ptr,
    pair_out_ptr,
    num_pairs,
    max_m_blocks,
    H,
    INTER,
    E,
    stride_we,
    stride_wn,
    s_ptr,
    stride_se,
    stride_sn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_POW2: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    SCALE: tl.constexpr = 0,
    SCALE_BN: tl.constexpr = 1,
    SCALE_BK: tl.constexpr = 1,
    WBITS: tl.constexpr = 0,
    HAS_ZP: tl.constexpr = False,
    HAS_PERM: tl.constexpr = False,
    MAGIC: tl.constexpr = 0,
    OFFSETS: tl.constexpr = False,
    z_ptr=None,
    p_ptr=None,
    HAS_BIAS: tl.constexpr = False,
    b_ptr=None,
    MXFP4: tl.constexpr = False,
):
    num_n = tl.cdiv(H, BLOCK_N)
    expert, pairs, row_ok, pid_n = _grouped_block(
        tl.program_id(0), counts_ptr, sorted_ptr, E, num_n, max_m_blocks,
        BLOCK_M, E_POW2, GROUP_M,
    )  # fmt: skip
    if expert < 0:
        return
    pairs64 = pairs.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_c = tl.minimum(cols, H - 1)
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = inter_ptr + pairs64[:, None] * INTER + kk[None, :]
    w_ptrs = (
        w2_ptr + expert.to(tl.int64) * stride_we + cols_c.to(tl.int64)[None, :] * stride_wn
        + kk[:, None]
    )  # fmt: skip
    scales = _w2_scale_rows(s_ptr, expert, cols_c, stride_se, stride_sn, SCALE, SCALE_BN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if MXFP4:  # MXFP4 experts (see the gate/up kernel)
        w_cols = w2_ptr + expert.to(tl.int64) * stride_we + cols_c.to(tl.int64) * stride_wn
        a_rows = inter_ptr + pairs64[:, None] * INTER
        for k0 in range(0, INTER, BLOCK_K):
            k = k0 + kk
            if EVEN_K:
                a = tl.load(a_rows + k[None, :], mask=row_ok[:, None], other=0.0)
            else:
                a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & (k < INTER)[None, :],
                            other=0.0)  # fmt: skip
            acc = _mxfp4_dot_step(acc, a, w_cols, scales, k0, INTER, EVEN_K, BLOCK_K, PRECISION)
    elif WBITS != 0:  # integer experts (see the gate/up kernel)
        w_cols = w2_ptr + expert.to(tl.int64) * stride_we + cols_c.to(tl.int64) * stride_wn
        zeros = None
        if HAS_ZP:
            zeros = _w2_scale_rows(z_ptr, expert, cols_c, stride_se, stride_sn, SCALE, SCALE_BN)
        a_rows = inter_ptr + pairs64[:, None] * INTER
        for k0 in range(0, INTER, BLOCK_K):
            k = k0 + kk
            k_ok = k < INTER
            if HAS_PERM:
                k = tl.load(p_ptr + expert.to(tl.int64) * INTER + k, mask=k_ok, other=0)
            if EVEN_K:
                a = tl.load(a_rows + k[None, :], mask=row_ok[:, None], other=0.0)
            else:
                a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _int_dot_step(
                acc, a, w_cols, scales, zeros, k0, INTER,
                EVEN_K, BLOCK_K, SCALE_BK, WBITS, HAS_ZP, MAGIC, PRECISION, OFFSETS,
            )  # fmt: skip
    else:
        for k0 in range(0, INTER, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_ptrs)
            else:
                k_ok = (k0 + kk) < INTER
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            if SCALE != 0:
                w = w.to(a.dtype)
            if SCALE == 2:
                kb = k0 // SCALE_BK
                acc += tl.dot(a, w, input_precision=PRECISION) * tl.load(scales + kb)[None, :]
            else:
                acc = tl.dot(a, w, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    if SCALE == 1:
        acc = acc * tl.load(scales)[None, :]
    if HAS_BIAS:  # the expert's down bias: part of its output, so weighted with it
        acc += tl.load(b_ptr + expert.to(tl.int64) * H + cols_c).to(tl.float32)[None, :]
    # Each expert's output rounds to the activation dtype (the intermediate's) before it is
    # weighted; the weighted output is stored in pair_out's: the activation dtype for
    # fused_moe (the same rounding again), float32 for fused_moe_biased (none until the sum).
    dtype = inter_ptr.dtype.element_ty
    weight = tl.load(topk_w_ptr + pairs64, mask=row_ok, other=0.0)
    y = acc.to(dtype).to(tl.float32) * weight[:, None]
    out = pair_out_ptr + pairs64[:, None] * H + cols[None, :]
    tl.store(out, y.to(pair_out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < H)[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _topk_sum_kernel(
    pair_out_ptr, ids_ptr, out_ptr, num_tokens, H, stride_ot,
    TOP_K: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        pair = token * TOP_K + k
        held = tl.load(ids_ptr + pair) >= 0
        y = tl.load(pair_out_ptr + pair * H + cols, mask=ok & held, other=0.0)
        total += y.to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, total.to(out_ptr.dtype.element_ty), mask=ok)


# ---- host side --------------------------------------------------------------------------------
def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(
    hidden, w13, w2, topk_weights, topk_ids, pack: int = 1, pack2: int | None = None
) -> tuple[int, ...]:
    """``(t, h, e, i, k)`` of a call, its shapes checked; ``pack`` values per element along
    the weights' last dimension (integer experts: ``32 / bits`` per int32 word), ``pack2``
    the down projection's where it differs."""
    t, h = hidden.shape
    e, two_i, h2 = w13.shape
    i = two_i // 2
    k = topk_ids.shape[1]
    pack2 = pack if pack2 is None else pack2
    if (
        h2 * pack != h
        or two_i % 2
        or i % pack2
        or tuple(w2.shape) != (e, h, i // pack2)
        or topk_weights.shape != topk_ids.shape
        or topk_ids.shape[0] != t
    ):
        raise ValueError(
            f"fused_moe shapes do not fit: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, "
            f"w2 {tuple(w2.shape)}, topk_weights {tuple(topk_weights.shape)}, topk_ids "
            f"{tuple(topk_ids.shape)}"
        )
    return t, h, e, i, k


@dataclass(frozen=True)
class ExpertScales:
    """FP8 experts' float32 scales as the kernels read them (see
    ``engine.kernels.reference.fused_moe_fp8``): ``mode`` 1 per output channel, 2 per
    ``(bn, bk)`` block; ``None`` in place of this object: unquantized experts."""

    w13: torch.Tensor
    w2: torch.Tensor
    mode: int
    bn: int = 1
    bk: int = 1

    def args(self, which: str) -> tuple[torch.Tensor, int, int]:
        t = self.w13 if which == "w13" else self.w2
        return t, t.stride(0), t.stride(1)

    def constexprs(self, which: str, grouped: bool) -> dict[str, int]:
        return {"SCALE": self.mode, "SCALE_BN": self.bn, "SCALE_BK": self.bk}

    def k_tile(self, block_k: int, which: str, grouped: bool) -> int:
        """The K step for ``block_k``: block scales need every step inside one block column."""
        return block_k if self.mode != 2 else math.gcd(block_k, self.bk)


@dataclass(frozen=True)
class IntegerExperts:
    """4/8-bit integer experts' scales, zero points and act-order permutations as the kernels
    read them (see ``engine.kernels.reference.fused_moe_wna16``): ``s13`` / ``s2`` the scales
    ``[E, N, groups]`` (the checkpoint's float dtype), ``z13`` / ``z2`` uint8 zero points of
    the same shapes (None: symmetric), or float32 offsets where ``offsets13`` / ``offsets2``,
    all contiguous;
    ``group13`` / ``group2`` the input features per group (one group per row: a power of two
    at least K, so every K step is in group 0); ``p13`` / ``p2`` int32 ``[E, K]`` act-order
    permutations or None; ``magic`` / ``magic2`` the grouped GEMMs' ``_dot_operand`` offset
    for the activation dtype; ``bits`` the gate/up width (the dispatch rules read it),
    ``bits2`` the down projection's."""

    bits: int
    s13: torch.Tensor
    s2: torch.Tensor
    z13: torch.Tensor | None
    z2: torch.Tensor | None
    group13: int
    group2: int
    p13: torch.Tensor | None = None
    p2: torch.Tensor | None = None
    magic: int = 0
    bits2: int = 0
    magic2: int = 0
    offsets13: bool = False
    offsets2: bool = False

    def args(self, which: str) -> tuple[torch.Tensor, int, int]:
        t = self.s13 if which == "w13" else self.s2
        return t, t.stride(0), t.stride(1)

    def constexprs(self, which: str, grouped: bool) -> dict:
        """The kernels' integer switches and extra arguments (zero points, permutation)."""
        w13 = which == "w13"
        zeros, perm = (self.z13, self.p13) if w13 else (self.z2, self.p2)
        out = {
            "SCALE": 2, "SCALE_BN": 1, "SCALE_BK": self.group13 if w13 else self.group2,
            "WBITS": self.bits if w13 else self.bits2, "HAS_ZP": zeros is not None,
            "HAS_PERM": perm is not None, "OFFSETS": self.offsets13 if w13 else self.offsets2,
            "z_ptr": zeros, "p_ptr": perm,
        }  # fmt: skip
        if grouped:
            out["MAGIC"] = self.magic if w13 else self.magic2
        else:
            out["one_bits"] = ONE_BITS
        return out

    def k_tile(self, block_k: int, which: str, grouped: bool) -> int:
        """The K step for ``block_k``: the grouped GEMMs correct and scale each step's product
        once per column, so a step lies inside one group; the decode GEMVs look each word
        column's group up and take any step."""
        if not grouped:
            return block_k
        return math.gcd(block_k, self.group13 if which == "w13" else self.group2)


@dataclass(frozen=True)
class Mxfp4Experts:
    """MXFP4 experts' E8M0 exponents as the kernels read them (see
    ``engine.kernels.reference.fused_moe_mxfp4``): uint8 ``s13 [E, 2I, H / 32]`` and ``s2
    [E, H, I / 32]``, one per 32 input features of a row, K contiguous. ``bits`` is what
    ``use_decode`` reads: 4-bit experts unpack in the grouped GEMMs' K loop, so decode serves
    more re-reads for them (the grouped tilings and the decode one are MXFP4's own choices,
    see ``MXFP4_DECODE`` and ``_fused_moe``)."""

    s13: torch.Tensor
    s2: torch.Tensor
    bits: int = 4

    def args(self, which: str) -> tuple[torch.Tensor, int, int]:
        t = self.s13 if which == "w13" else self.s2
        return t, t.stride(0), t.stride(1)

    def constexprs(self, which: str, grouped: bool) -> dict:
        return {"MXFP4": True}

    def k_tile(self, block_k: int, which: str, grouped: bool) -> int:
        """The K step: whole 32-feature blocks, a power of two of them (a step may span
        blocks: each block's exponent is loaded with its bytes)."""
        if block_k % MXFP4_BLOCK or block_k & (block_k - 1):
            raise ValueError(
                f"fused_moe_mxfp4: a K step of {block_k} features is not a power-of-two "
                f"multiple of the MXFP4 block of {MXFP4_BLOCK}"
            )
        return block_k


Scales = ExpertScales | IntegerExperts | Mxfp4Experts | None


def _scale_args(scales: Scales, which: str, dummy: torch.Tensor) -> tuple:
    return (dummy, 0, 0) if scales is None else scales.args(which)


def _scale_constexprs(scales: Scales, which: str, grouped: bool) -> dict:
    return {} if scales is None else scales.constexprs(which, grouped)


def _k_tile(scales: Scales, block_k: int, which: str, grouped: bool) -> int:
    return block_k if scales is None else scales.k_tile(block_k, which, grouped)


@dataclass(frozen=True)
class ExpertEpilogue:
    """``fused_moe_biased``'s additions to the kernels (see the module docstring): the
    per-expert biases ``b13 [E, 2I]`` / ``b2 [E, H]`` (contiguous; None: none), the
    ``ACTIVATION`` code and its ``alpha`` / ``limit``. ``None`` in place of this object: the
    other ops, whose kernels compile without any of it."""

    b13: torch.Tensor | None
    b2: torch.Tensor | None
    activation: int
    alpha: float
    limit: float

    @classmethod
    def checked(
        cls,
        op: str,
        dims: tuple[int, ...],
        w13_bias: torch.Tensor | None,
        w2_bias: torch.Tensor | None,
        activation: str,
        alpha: float,
        limit: float,
        bias_dtype: torch.dtype | None = None,
    ) -> ExpertEpilogue:
        """The epilogue of op ``op`` (for its errors) on experts of ``_check``'s ``dims``:
        the activation known and each bias a float tensor of its shape (``ValueError``
        otherwise), made contiguous (and cast to ``bias_dtype`` when given)."""
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"unknown MoE activation {activation!r}; supported: "
                f"{', '.join(ref.MOE_ACTIVATIONS)}"
            )
        _, h, e, i, _ = dims
        for name, bias, want in (("w13_bias", w13_bias, (e, 2 * i)), ("w2_bias", w2_bias, (e, h))):
            if bias is not None and (tuple(bias.shape) != want or not bias.is_floating_point()):
                raise ValueError(
                    f"{op}: {name} {tuple(bias.shape)} {bias.dtype} does not fit: "
                    f"expected a float tensor of shape {want}"
                )

        def operand(bias: torch.Tensor | None) -> torch.Tensor | None:
            if bias is None:
                return None
            return (bias if bias_dtype is None else bias.to(bias_dtype)).contiguous()

        return cls(operand(w13_bias), operand(w2_bias), ACTIVATIONS[activation], float(alpha),
                   float(limit))  # fmt: skip

    def constexprs(self, which: str) -> dict:
        """The switches and extra arguments of the ``which`` ("w13" / "w2") kernels; the
        activation's floats only where the clamped SwiGLU reads them (SiLU's kernels compile
        with ``None`` there)."""
        if which == "w2":
            return {"HAS_BIAS": self.b2 is not None, "b_ptr": self.b2}
        out = {"HAS_BIAS": self.b13 is not None, "b_ptr": self.b13, "ACTIVATION": self.activation}
        if self.activation == ACTIVATIONS["swigluoai"]:
            out.update(alpha=float(self.alpha), limit=float(self.limit))
        return out


def _epilogue_constexprs(epilogue: ExpertEpilogue | None, which: str) -> dict:
    return {} if epilogue is None else epilogue.constexprs(which)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    variant: str | None = None,
    decode_config: DecodeConfig | None = None,
    config: GroupedConfig | None = None,
) -> torch.Tensor:
    """See ``engine.kernels.reference.fused_moe``. ``variant`` ("decode" / "grouped") and the
    configurations override the rules (tests and the benchmark use them)."""
    dims = _check(hidden, w13, w2, topk_weights, topk_ids)
    return _fused_moe(
        hidden, w13, w2, topk_weights, topk_ids, dims, None, variant, decode_config, config
    )


def fused_moe_fp8(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    block_size: tuple[int, int] | list[int] | None = None,
    *,
    variant: str | None = None,
    decode_config: DecodeConfig | None = None,
    config: GroupedConfig | None = None,
) -> torch.Tensor:
    """See ``engine.kernels.reference.fused_moe_fp8``: FP8 (e4m3) experts, **weight-only**.

    The same kernels as ``fused_moe`` (same dispatch, configurations and rounding points),
    loading one byte per weight instead of two (what decode is bound by) and converting it in
    registers: the decode GEMVs scale each weight in float32 (per channel: the row's sum once);
    the grouped GEMMs convert the e4m3 tile to the activation dtype (exact) for the tensor
    cores and scale the float32 product, per column after the K loop (per channel) or per K
    step (block scales: the K step is cut to divide the block's width, so each step lies in
    one block column). Activations are not quantized (no W8A8): the FP8 tensor-core path for
    large prefill batches is not written yet."""
    dims = _check(hidden, w13, w2, topk_weights, topk_ids)
    _, h, e, i, _ = dims
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fused_moe_fp8 takes float8_e4m3fn experts, got {w13.dtype}/{w2.dtype}")
    if block_size is None:
        want13, want2 = (e, 2 * i), (e, h)
        scales = ExpertScales(w13_scale.float().contiguous(), w2_scale.float().contiguous(), 1)
    else:
        bn, bk = int(block_size[0]), int(block_size[1])
        if bk % 16:
            raise ValueError(
                f"fused_moe_fp8: block scales {bn}x{bk} need block columns that are a multiple "
                "of 16 (the tensor-core K step)"
            )
        want13 = (e, 2 * triton.cdiv(i, bn), triton.cdiv(h, bk))
        want2 = (e, triton.cdiv(h, bn), triton.cdiv(i, bk))
        scales = ExpertScales(
            w13_scale.float().contiguous(), w2_scale.float().contiguous(), 2, bn, bk
        )
    if tuple(w13_scale.shape) != want13 or tuple(w2_scale.shape) != want2:
        raise ValueError(
            f"fused_moe_fp8 scales do not fit: w13_scale {tuple(w13_scale.shape)} (expected "
            f"{want13}), w2_scale {tuple(w2_scale.shape)} (expected {want2}), block_size "
            f"{block_size}"
        )
    return _fused_moe(
        hidden, w13, w2, topk_weights, topk_ids, dims, scales, variant, decode_config, config
    )


# The integer decode GEMVs' default tiling per bit width: a K step of 4-bit words holds a
# quarter of FP8's bytes, so its steps are longer; the gate/up words tile is 16 x 256 bytes
# either way (128 registers at 4 bits symmetric in an sm_90 compile, bf16's default takes
# 125). Not measured on a GPU yet: the MoE sweep's --moe-wna16 times other tilings too.
# The decode GEMVs' tilings by bit width. 4 bits: the H100 sweep's best at every decode batch
# (Qwen3-30B-A3B batch 1: 27.4 us a layer against 33.3 for n16 k512 three stages; Mixtral:
# 306 vs 375 us).
WNA16_DECODE = {
    4: DecodeConfig(gate_up_n=8, gate_up_k=1024, down_n=8, down_k=256, num_stages=4),
    8: DecodeConfig(gate_up_n=16, gate_up_k=256, down_n=8, down_k=256),
}
# Input features per group that the grouped GEMMs' K steps can hold (the tensor-core K step).
WNA16_GROUP_MULTIPLE = 16
# MXFP4 experts' decode tiling, not timed on a GPU yet: 8 rows of 256 bytes a K step (2 KiB of
# each projection), chosen in an sm_90 compile without a GPU (ptxas): 96 registers for gate/up
# and 69 for down, no spills, where the 4-bit integer tiling (8 x 1,024 features) takes 252.
MXFP4_DECODE = DecodeConfig(gate_up_n=8, gate_up_k=512, down_n=8, down_k=512, num_stages=4)


def fused_moe_wna16(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scales: torch.Tensor,
    w2_scales: torch.Tensor,
    w13_zeros: torch.Tensor | None = None,
    w2_zeros: torch.Tensor | None = None,
    bits: int = 4,
    w13_perm: torch.Tensor | None = None,
    w2_perm: torch.Tensor | None = None,
    w13_offsets: torch.Tensor | None = None,
    w2_offsets: torch.Tensor | None = None,
    w2_bits: int | None = None,
    *,
    variant: str | None = None,
    decode_config: DecodeConfig | None = None,
    config: GroupedConfig | None = None,
) -> torch.Tensor:
    """See ``engine.kernels.reference.fused_moe_wna16``: 4/8-bit integer experts in groups,
    **weight-only** (W4A16 / W8A16), act-order included.

    The same kernels, dispatch, grouped configurations and rounding points as ``fused_moe``
    and ``fused_moe_fp8``, with ``WBITS`` set (see the module docstring): the packed words
    are loaded (an eighth of bf16's bytes at 4 bits, what decode is bound by) and unpacked in
    registers; the decode GEMVs default to ``WNA16_DECODE[bits]``. Groups must hold a multiple of
    16 input features (the grouped GEMMs' K step; checkpoints use 32, 64, 128) unless there is
    one per row. Scales are read in their own dtype (float32 or float16), never copied.

    Float offsets (``w13_offsets`` / ``w2_offsets``, each optional: GGUF's ``W = q s + o``)
    take the zero points' place in the kernels (an ``OFFSETS`` switch: ``s x.q + o sum(x)``;
    a projection without them is symmetric), and the down
    projection may have its own width (``w2_bits``): a constexpr per launch, so each
    projection's kernel compiles for its own."""
    bits2 = bits if w2_bits is None else w2_bits
    if bits not in (4, 8) or bits2 not in (4, 8):
        raise ValueError(f"fused_moe_wna16 takes 4- or 8-bit experts, got {bits}/{bits2}")
    if w13.dtype != torch.int32 or w2.dtype != torch.int32:
        raise ValueError(f"fused_moe_wna16 takes int32-packed experts, got {w13.dtype}/{w2.dtype}")
    dims = _check(hidden, w13, w2, topk_weights, topk_ids, 32 // bits, 32 // bits2)
    _, h, e, i, _ = dims
    offsets = (w13_offsets is not None, w2_offsets is not None)
    if any(offsets) and (w13_zeros is not None or w2_zeros is not None):
        raise ValueError("fused_moe_wna16: offsets take the zero points' place, never both")
    zeros = (w13_zeros, w2_zeros)  # the zero points' or the offsets' pointers
    if any(offsets):
        zeros = (w13_offsets, w2_offsets)
    pairs = ((zeros[0], w13_scales), (zeros[1], w2_scales))
    if (
        w13_scales.dim() != 3
        or w2_scales.dim() != 3
        or tuple(w13_scales.shape[:2]) != (e, 2 * i)
        or tuple(w2_scales.shape[:2]) != (e, h)
        or h % w13_scales.shape[2]
        or i % w2_scales.shape[2]
        or (not any(offsets) and (w13_zeros is None) != (w2_zeros is None))
        or any(z is not None and z.shape != s.shape for z, s in pairs)
    ):
        raise ValueError(
            f"fused_moe_wna16 scales do not fit: w13_scales {tuple(w13_scales.shape)}, "
            f"w2_scales {tuple(w2_scales.shape)} for {e} experts of hidden {h}, intermediate "
            f"{i} (groups dividing each row); zero points: both or neither, in the scales' "
            "shapes"
        )
    groups = []
    for scales, size in ((w13_scales, h), (w2_scales, i)):
        count = scales.shape[2]
        group = size // count
        if count == 1:  # one group per row: every K step in group 0
            group = triton.next_power_of_2(size)
        elif group % WNA16_GROUP_MULTIPLE:
            raise ValueError(
                f"fused_moe_wna16: groups of {group} input features need a multiple of "
                f"{WNA16_GROUP_MULTIPLE} (the tensor-core K step) or one group per row"
            )
        groups.append(group)
    perms = []
    for which, perm, size in (("w13", w13_perm, h), ("w2", w2_perm, i)):
        if perm is not None and tuple(perm.shape) != (e, size):
            raise ValueError(
                f"fused_moe_wna16: {which} permutation {tuple(perm.shape)} does not fit "
                f"({e}, {size})"
            )
        perms.append(None if perm is None else perm.to(torch.int32).contiguous())

    def contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.contiguous()

    scales = IntegerExperts(
        bits, w13_scales.contiguous(), w2_scales.contiguous(), contiguous(zeros[0]),
        contiguous(zeros[1]), groups[0], groups[1], perms[0], perms[1],
        _magic(hidden.dtype, bits), bits2, _magic(hidden.dtype, bits2), *offsets,
    )  # fmt: skip
    return _fused_moe(
        hidden, w13, w2, topk_weights, topk_ids, dims, scales, variant, decode_config, config
    )


def fused_moe_biased(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    *,
    variant: str | None = None,
    decode_config: DecodeConfig | None = None,
    config: GroupedConfig | None = None,
) -> torch.Tensor:
    """See ``engine.kernels.reference.fused_moe_biased``: experts with per-expert biases
    (``w13_bias [E, 2I]``, ``w2_bias [E, H]``, each optional) and SiLU-and-mul or GPT-OSS's
    clamped SwiGLU (``activation`` "swigluoai", with ``alpha`` and ``limit``).

    The same kernels, dispatch and configurations as ``fused_moe`` with the ``HAS_BIAS`` and
    ``ACTIVATION`` switches on (see the module docstring); the grouped path keeps the weighted
    expert outputs in float32 until the top-k sum. Serves unquantized experts in the
    activations' dtype (bfloat16, float16, float32); anything else is refused with a
    ``ValueError`` rather than computed differently from the reference."""
    if hidden.dtype not in DTYPES or w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(
            "fused_moe_biased (Triton) runs unquantized experts in the activations' dtype "
            f"(bfloat16, float16, float32); got hidden {hidden.dtype}, w13 {w13.dtype}, w2 "
            f"{w2.dtype}"
        )
    dims = _check(hidden, w13, w2, topk_weights, topk_ids)
    epilogue = ExpertEpilogue.checked(
        "fused_moe_biased", dims, w13_bias, w2_bias, activation, alpha, limit
    )
    return _fused_moe(
        hidden, w13, w2, topk_weights, topk_ids, dims, None, variant, decode_config, config,
        epilogue,
    )  # fmt: skip


# NOT REGISTERED YET: ``fused_moe_mxfp4`` is importable (``from engine_triton.kernels.fused_moe
# import fused_moe_mxfp4``; the interpreter tests call it and register it for the cpu platform
# themselves) but ``engine_triton.kernels.register`` leaves it out for cuda/rocm until it has run
# on a GPU (``tests/gpu/test_fused_moe_gpu.py -k mxfp4``): registering it flips GPT-OSS on GPUs
# from dequantizing its experts at load (``fused_moe_biased``) to keeping them in MXFP4
# (``engine.quantization.mxfp4.Mxfp4Config.bind``).
def fused_moe_mxfp4(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scales: torch.Tensor,
    w2_scales: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "swigluoai",
    alpha: float = 1.702,
    limit: float = 7.0,
    *,
    variant: str | None = None,
    decode_config: DecodeConfig | None = None,
    config: GroupedConfig | None = None,
) -> torch.Tensor:
    """See ``engine.kernels.reference.fused_moe_mxfp4``: GPT-OSS's experts as released, MXFP4
    weights (uint8 ``w13 [E, 2I, H / 2]``, ``w2 [E, H, I / 2]``: two E2M1 codes a byte, low
    nibble first; uint8 E8M0 exponents ``w13_scales [E, 2I, H / 32]``, ``w2_scales [E, H, I /
    32]``) with per-expert biases and SiLU-and-mul or the clamped SwiGLU, **weight-only**.

    ``fused_moe_biased``'s kernels, dispatch and rounding points with the ``MXFP4`` switch on
    (see the module docstring): the bytes are decoded in registers, their exponent folded in,
    never dequantized to memory; ``use_decode``'s 4-bit rule, ``MXFP4_DECODE`` and the general
    grouped tilings. The biases are read in the activations' dtype, as the reference rounds
    them. H and I must be multiples of 32 (whole blocks); anything else is refused with a
    ``ValueError``."""
    if hidden.dtype not in DTYPES:
        raise ValueError(
            f"fused_moe_mxfp4 takes bfloat16, float16 or float32 activations, got {hidden.dtype}"
        )
    tensors = (("w13", w13), ("w2", w2), ("w13_scales", w13_scales), ("w2_scales", w2_scales))
    for name, t in tensors:
        if t.dtype != torch.uint8:
            raise ValueError(
                f"fused_moe_mxfp4: {name} must be uint8 (MXFP4 codes two a byte / E8M0 "
                f"exponents), got {t.dtype}"
            )
    dims = _check(hidden, w13, w2, topk_weights, topk_ids, 2)
    _, h, e, i, _ = dims
    if h % MXFP4_BLOCK or i % MXFP4_BLOCK:
        raise ValueError(
            f"fused_moe_mxfp4: hidden {h} and intermediate {i} must be multiples of the MXFP4 "
            f"block of {MXFP4_BLOCK}"
        )
    want13, want2 = (e, 2 * i, h // MXFP4_BLOCK), (e, h, i // MXFP4_BLOCK)
    if tuple(w13_scales.shape) != want13 or tuple(w2_scales.shape) != want2:
        raise ValueError(
            f"fused_moe_mxfp4 scales do not fit: w13_scales {tuple(w13_scales.shape)} (expected "
            f"{want13}), w2_scales {tuple(w2_scales.shape)} (expected {want2})"
        )
    scales = Mxfp4Experts(w13_scales.contiguous(), w2_scales.contiguous())
    # The biases in the activations' dtype, as the reference rounds them.
    epilogue = ExpertEpilogue.checked(
        "fused_moe_mxfp4", dims, w13_bias, w2_bias, activation, alpha, limit, hidden.dtype
    )
    return _fused_moe(
        hidden, w13, w2, topk_weights, topk_ids, dims, scales, variant, decode_config, config,
        epilogue,
    )  # fmt: skip


def _fused_moe(
    hidden, w13, w2, topk_weights, topk_ids, dims, scales, variant, decode_config, config,
    epilogue: ExpertEpilogue | None = None,
) -> torch.Tensor:  # fmt: skip
    """The shared body of ``fused_moe``, ``fused_moe_fp8``, ``fused_moe_wna16``,
    ``fused_moe_biased`` (``epilogue``) and ``fused_moe_mxfp4`` (both); ``dims`` is
    ``_check``'s ``(t, h, e, i, k)``, validated once by the caller."""
    t, h, e, i, k = dims
    out = torch.empty((t, h), dtype=hidden.dtype, device=hidden.device)
    if t == 0:
        return out
    x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    # 4-bit experts (integer or MXFP4) take their own dispatch rule and tilings.
    bits = scales.bits if isinstance(scales, (IntegerExperts, Mxfp4Experts)) else 0
    if variant is None:
        variant = "decode" if use_decode(t, k, e, bits) else "grouped"
    if variant == "decode":
        if decode_config is None:
            if isinstance(scales, Mxfp4Experts):
                decode_config = MXFP4_DECODE
            else:
                decode_config = WNA16_DECODE[bits] if bits else DecodeConfig()
        _run_decode(x, w13, w2, weights, ids, out, decode_config, scales, epilogue)
    elif variant == "grouped":
        # The 4-bit tilings were swept with 16-bit activations; float32 ones need twice the
        # shared memory per stage (m16 n128 four stages asked for 275 KiB on an H100 and failed
        # to launch), so they keep the general rule. So do experts whose down projection has
        # another width (GGUF Q4_K gate/up with Q6_K down in bytes, groups of 16): on an H100,
        # Qwen3-30B-A3B's shape at 32 tokens took 1,065 us a layer with the 4-bit tiling and
        # 606 us with the general rule's (`moe-kernels-gguf`, 2026-12-07).
        # MXFP4 experts take the general rule too: in an sm_90 compile (ptxas, no GPU) the
        # 4-bit tilings spill registers in their gate/up GEMM (m16 n128 k128: 544 bytes) and
        # the general rule's do not; neither is timed on a GPU yet.
        same_width = not isinstance(scales, IntegerExperts) or scales.bits2 == bits
        own_rule = same_width and not isinstance(scales, Mxfp4Experts)
        rule_bits = bits if x.element_size() == 2 and own_rule else 0
        cfg = config or grouped_config(t * k, e, rule_bits)
        _run_grouped(x, w13, w2, weights, ids, out, cfg, scales, epilogue)
    else:
        raise ValueError(f"unknown fused_moe variant {variant!r} (decode, grouped)")
    return out


def _run_decode(
    x, w13, w2, weights, ids, out, cfg: DecodeConfig, scales=None, epilogue=None
) -> None:
    t, h = x.shape
    e, two_i, _ = w13.shape
    i = two_i // 2
    k = ids.shape[1]
    pairs = t * k
    inter = torch.empty((pairs, i), dtype=x.dtype, device=x.device)
    grid_n = triton.cdiv(h, cfg.down_n)
    ws, counters = _SCRATCH.get(x.device, pairs * h, t * grid_n)
    gu_k = _k_tile(scales, cfg.gate_up_k, "w13", False)
    down_k = _k_tile(scales, cfg.down_k, "w2", False)
    _decode_gate_up_kernel[(pairs, triton.cdiv(i, cfg.gate_up_n))](
        x, w13, ids, inter, pairs, h, i, x.stride(0), w13.stride(0), w13.stride(1),
        *_scale_args(scales, "w13", w13),
        TOP_K=k, BLOCK_N=cfg.gate_up_n, BLOCK_K=gu_k, EVEN_K=h % gu_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x.device),
        **_scale_constexprs(scales, "w13", False), **_epilogue_constexprs(epilogue, "w13"),
    )  # fmt: skip
    _decode_down_kernel[(pairs, grid_n)](
        inter, w2, ids, weights, out, ws, counters, t, h, i, w2.stride(0), w2.stride(1),
        out.stride(0), *_scale_args(scales, "w2", w2),
        TOP_K=k, BLOCK_N=cfg.down_n, BLOCK_K=down_k, EVEN_K=i % down_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x.device),
        **_scale_constexprs(scales, "w2", False), **_epilogue_constexprs(epilogue, "w2"),
    )  # fmt: skip


# The decode path's top-k sum workspace (float32 partials) and arrival counters (kept zeroed
# by the kernel), per device; grown, never shrunk (captured graphs keep their addresses).
_SCRATCH = _Scratch()
ALIGN_BLOCK = 256


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """Group the pairs of ``ids`` ([T, K] int32) by expert: returns ``(counts [E] int32,
    sorted [max_m_blocks * block_m] int32, max_m_blocks)`` where expert e's pairs occupy
    ``sorted[start_e : start_e + counts[e]]`` with ``start_e`` the sum of the earlier
    experts' counts rounded up to ``block_m``; slots past a run are padding (never read)."""
    pairs = ids.numel()
    device = ids.device
    max_m_blocks = triton.cdiv(pairs, block_m) + min(num_experts, pairs)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(pairs, dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(max_m_blocks * block_m, dtype=torch.int32, device=device)
    e_pow2 = triton.next_power_of_2(num_experts)
    grid = (triton.cdiv(pairs, ALIGN_BLOCK),)
    _align_count_kernel[grid](ids, counts, rank, pairs, num_experts, BLOCK=ALIGN_BLOCK)
    scatter_block = max(16, min(ALIGN_BLOCK, 16384 // e_pow2))
    _align_scatter_kernel[(triton.cdiv(pairs, scatter_block),)](
        ids, rank, counts, sorted_pairs, pairs, num_experts,
        BLOCK_M=block_m, E_POW2=e_pow2, BLOCK=scatter_block,
    )  # fmt: skip
    return counts, sorted_pairs, max_m_blocks


def _run_grouped(
    x, w13, w2, weights, ids, out, cfg: GroupedConfig, scales=None, epilogue=None
) -> None:
    t, h = x.shape
    e, two_i, _ = w13.shape
    i = two_i // 2
    k = ids.shape[1]
    pairs = t * k
    counts, sorted_pairs, max_m = moe_align(ids, e, cfg.block_m)
    e_pow2 = triton.next_power_of_2(e)
    precision = _precision(x.dtype)
    inter = torch.empty((pairs, i), dtype=x.dtype, device=x.device)
    gu_n = cfg.gate_up_block_n
    block_k = _k_tile(scales, cfg.block_k, "w13", True)
    down_k = _k_tile(scales, cfg.block_k, "w2", True)
    _grouped_gate_up_kernel[(max_m * triton.cdiv(i, gu_n),)](
        x, w13, counts, sorted_pairs, inter, pairs, max_m, h, i, e,
        x.stride(0), w13.stride(0), w13.stride(1), *_scale_args(scales, "w13", w13),
        TOP_K=k, BLOCK_M=cfg.block_m, BLOCK_N=gu_n, BLOCK_K=block_k,
        GROUP_M=cfg.group_m, E_POW2=e_pow2, EVEN_K=h % block_k == 0, PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_scale_constexprs(scales, "w13", True), **_epilogue_constexprs(epilogue, "w13"),
    )  # fmt: skip
    # fused_moe_biased keeps the weighted expert outputs in float32 until the top-k sum (its
    # spec's rounding points); the other ops store them in the activation dtype (half the
    # bytes, within one rounding of their references).
    pair_dtype = x.dtype if epilogue is None else torch.float32
    pair_out = torch.empty((pairs, h), dtype=pair_dtype, device=x.device)
    _grouped_down_kernel[(max_m * triton.cdiv(h, cfg.block_n),)](
        inter, w2, counts, sorted_pairs, weights, pair_out, pairs, max_m, h, i, e,
        w2.stride(0), w2.stride(1), *_scale_args(scales, "w2", w2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=down_k, GROUP_M=cfg.group_m,
        E_POW2=e_pow2, EVEN_K=i % down_k == 0, PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_scale_constexprs(scales, "w2", True), **_epilogue_constexprs(epilogue, "w2"),
    )  # fmt: skip
    block = min(1024, triton.next_power_of_2(h))
    _topk_sum_kernel[(t, triton.cdiv(h, block))](
        pair_out, ids, out, t, h, out.stride(0), TOP_K=k, BLOCK=block,
        num_warps=4 if block >= 512 else 1,
    )  # fmt: skip


def _wna16_conformance_tolerance(dtype: str) -> tuple[float, float] | None:
    """The conformance kit's (rtol, atol) for ``fused_moe_wna16`` in 16-bit dtypes: the
    attention kernels' (about twice the plain kernels'). The kernel applies zero points through
    the activations' sum (``s * (x.q - z * sum(x))``) and sums K in another order than the
    reference's ``x . ((q - z) * s)``, so a gate/up output near a rounding boundary can round
    the other way before SiLU-and-mul and the down projection: seen as 1 element in 4,224 at
    0.0225 (bfloat16, atol 0.02) and 0.0024 (float16, atol 0.002) at 33 tokens, H = I = 128."""
    from engine.testing.inputs import ATTENTION_TOLERANCE

    return ATTENTION_TOLERANCE[dtype] if dtype in ("bfloat16", "float16") else None


fused_moe_wna16.conformance_tolerance = _wna16_conformance_tolerance  # type: ignore[attr-defined]
