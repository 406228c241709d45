"""Skinny GEMM for decode batches: ``y[M, N] = x[M, K] @ W[N, K]^T (+ bias)`` with M <= 16.

At decode sizes a linear layer is a stream over its weight: every weight element is used M <= 16
times, so the kernel is bound by memory bandwidth and its job is to keep enough bytes in flight.
Each program owns ``BLOCK_N`` output features and reads ``W[BLOCK_N, K]`` once, in ``BLOCK_K``
chunks along K (rows of W are contiguous, so loads are coalesced); the few rows of x are read by
every program (they stay in L1/L2). Arithmetic is float32; the output is in x's dtype.

Two inner products, picked per configuration (``dot``):

* FMA (``dot=False``): a float32 ``[BLOCK_M, BLOCK_N, BLOCK_K]`` register accumulator of
  elementwise products, reduced over K once after the loop (no per-chunk shuffles). For M <= 4.
* Tensor cores (``dot=True``): ``tl.dot(W_tile, x_tile^T)`` with x padded to 16 rows, so W is the
  large operand of the MMA (``BLOCK_N`` >= 64 lets Hopper use wgmma). For M = 8..16.

Rows past M and features past N are clamped to a valid index rather than masked, so the weight
loads carry no mask and stay vectorized; their results are dropped at the store. K is masked only
when it is not a multiple of ``BLOCK_K * SPLIT_K`` (``EVEN_K``).

Split-K (``SPLIT_K > 1``, for layers with few output features such as o_proj/down, N = 1024):
the grid is ``(N / BLOCK_N, SPLIT_K)``; each program writes a float32 partial to a workspace and
bumps an arrival counter per feature block; the last program to arrive sums the partials, adds
the bias and writes y, and puts the counter back to zero. One launch, no memset, no reduce
kernel, so it can be captured in a CUDA graph. The workspace and counters are cached per device
and never freed or shrunk (captured graphs keep their addresses); the first call at a size runs
eagerly (the model runner's warm-up before each capture), so growth happens outside capture.

Configurations come from ``config_for(m, n, k)``: ``TUNED`` (exact shapes, measured with
``python -m engine_triton.benchmark --linear-only``) first, then a rule of thumb. ``linear`` is
the registered op: it takes this path for 2-D bf16/fp16 CUDA inputs of at most 16 rows and
calls ``torch.nn.functional.linear`` otherwise.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine_triton.kernels import pdl
from engine_triton.kernels.pdl import pdl_launch, pdl_prefetch_wait, pdl_wait

MAX_M = 16
DTYPES = (torch.bfloat16, torch.float16)
# Device types ``linear`` sends to the kernel (ROCm's torch reports "cuda" too). Interpreter
# tests widen it to "cpu" to exercise the rest of the rule.
DEVICE_TYPES = ("cuda",)
SM_COUNT_FALLBACK = 132  # H200


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch configuration. ``dot``: tensor-core inner product (x padded to 16 rows)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    dot: bool = False

    def as_dict(self) -> dict:
        return asdict(self)

    def short(self) -> str:
        kind = "dot" if self.dot else "fma"
        return (
            f"{kind} n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages}"
            f" sk{self.split_k}"
        )


C = SkinnyConfig

# Exact-shape choices, keyed by (M bucket, N, K); M buckets are 1, 2, 4, 8, 16. ``None`` means
# cuBLAS (``F.linear``) was faster. Measured on an H200 in CUDA graphs of 100 calls
# (``python -m engine_triton.benchmark --linear-only``, 2026-11-29): the fastest candidate where it
# beat cuBLAS by more than 1%; comments give its us/call against cuBLAS's. Shapes missing here take
# ``_rule_of_thumb`` for one row (it beat cuBLAS on 9 of the 10 measured shapes) and cuBLAS for
# more rows (the rule lost to cuBLAS on most of them).
TUNED: dict[tuple[int, int, int], SkinnyConfig | None] = {
    (1, 4096, 1024): C(4, 512, 2, 4, 1, False),  # qwen3-0.6b qkv: 4.09 vs 4.77
    (2, 4096, 1024): None,  # qwen3-0.6b qkv: 5.33 vs 5.13
    (4, 4096, 1024): None,  # qwen3-0.6b qkv: 5.91 vs 5.13
    (8, 4096, 1024): None,  # qwen3-0.6b qkv: 5.6 vs 5.13
    (16, 4096, 1024): C(32, 128, 4, 4, 1, True),  # qwen3-0.6b qkv: 4.94 vs 5.14
    (1, 1024, 2048): C(8, 1024, 8, 2, 1, False),  # qwen3-0.6b o: 3.56 vs 12.56
    (2, 1024, 2048): C(8, 512, 8, 2, 1, False),  # qwen3-0.6b o: 5.43 vs 12.74
    (4, 1024, 2048): C(32, 256, 4, 3, 4, True),  # qwen3-0.6b o: 5.43 vs 10.38
    (8, 1024, 2048): C(32, 256, 4, 3, 4, True),  # qwen3-0.6b o: 5.47 vs 5.86
    (16, 1024, 2048): C(32, 256, 4, 3, 4, True),  # qwen3-0.6b o: 5.45 vs 5.83
    (1, 6144, 1024): C(4, 512, 2, 4, 1, False),  # qwen3-0.6b gate_up: 5.0 vs 5.82
    (2, 6144, 1024): None,  # qwen3-0.6b gate_up: 6.35 vs 5.8
    (4, 6144, 1024): None,  # qwen3-0.6b gate_up: 7.06 vs 5.83
    (8, 6144, 1024): None,  # qwen3-0.6b gate_up: 6.48 vs 5.85
    (16, 6144, 1024): None,  # qwen3-0.6b gate_up: 6.0 vs 5.89
    (1, 1024, 3072): C(8, 1024, 8, 2, 1, False),  # qwen3-0.6b down: 4.31 vs 7.42
    (2, 1024, 3072): C(8, 512, 8, 2, 1, False),  # qwen3-0.6b down: 6.93 vs 7.4
    (4, 1024, 3072): C(32, 256, 4, 3, 4, True),  # qwen3-0.6b down: 6.19 vs 7.53
    (8, 1024, 3072): C(32, 256, 4, 3, 4, True),  # qwen3-0.6b down: 6.21 vs 7.45
    (16, 1024, 3072): C(32, 256, 4, 3, 4, True),  # qwen3-0.6b down: 6.26 vs 7.6
    (1, 151936, 1024): C(4, 512, 2, 4, 1, False),  # qwen3-0.6b lm_head: 69.59 vs 74.66
    (2, 151936, 1024): None,  # qwen3-0.6b lm_head: 94.69 vs 75.34
    (4, 151936, 1024): C(128, 128, 4, 3, 1, True),  # qwen3-0.6b lm_head: 75.23 vs 76.29
    (8, 151936, 1024): C(128, 128, 4, 3, 1, True),  # qwen3-0.6b lm_head: 73.27 vs 77.2
    (16, 151936, 1024): C(128, 128, 4, 3, 1, True),  # qwen3-0.6b lm_head: 74.63 vs 78.74
    (1, 6144, 4096): C(4, 512, 2, 4, 1, False),  # llama-8b qkv: 13.93 vs 16.29
    (2, 6144, 4096): None,  # llama-8b qkv: 16.77 vs 15.98
    (4, 6144, 4096): None,  # llama-8b qkv: 16.79 vs 15.83
    (8, 6144, 4096): None,  # llama-8b qkv: 16.48 vs 15.44
    (16, 6144, 4096): None,  # llama-8b qkv: 15.89 vs 15.69
    (1, 4096, 4096): C(4, 512, 2, 4, 1, False),  # llama-8b o: 10.82 vs 13.31
    (2, 4096, 4096): None,  # llama-8b o: 14.34 vs 13.14
    (4, 4096, 4096): None,  # llama-8b o: 13.44 vs 13.0
    (8, 4096, 4096): None,  # llama-8b o: 13.02 vs 12.96
    (16, 4096, 4096): None,  # llama-8b o: 12.81 vs 12.38
    (1, 28672, 4096): None,  # llama-8b gate_up: 55.06 vs 54.67
    (2, 28672, 4096): None,  # llama-8b gate_up: 63.7 vs 54.63
    (4, 28672, 4096): None,  # llama-8b gate_up: 57.18 vs 55.13
    (8, 28672, 4096): None,  # llama-8b gate_up: 56.53 vs 55.15
    (16, 28672, 4096): None,  # llama-8b gate_up: 57.17 vs 55.71
    (1, 4096, 14336): C(4, 512, 2, 4, 1, False),  # llama-8b down: 29.97 vs 31.16
    (2, 4096, 14336): None,  # llama-8b down: 38.66 vs 31.3
    (4, 4096, 14336): None,  # llama-8b down: 33.51 vs 31.51
    (8, 4096, 14336): None,  # llama-8b down: 33.64 vs 31.66
    (16, 4096, 14336): None,  # llama-8b down: 32.42 vs 32.05
    (1, 128256, 4096): C(4, 512, 2, 4, 1, False),  # llama-8b lm_head: 230.68 vs 237.39
    (2, 128256, 4096): None,  # llama-8b lm_head: 270.54 vs 239.09
    (4, 128256, 4096): C(128, 128, 4, 3, 1, True),  # llama-8b lm_head: 235.11 vs 242.42
    (8, 128256, 4096): C(128, 128, 4, 3, 1, True),  # llama-8b lm_head: 233.91 vs 241.3
    (16, 128256, 4096): C(128, 128, 4, 3, 1, True),  # llama-8b lm_head: 235.97 vs 246.46
    # Qwen3-30B-A3B at one row, measured on an H100 (2026-12-06, same tool, us/call in a graph).
    # Its lm_head (151936 x 2048) keeps the rule: 194.19 against 194.30 with C(4, 512, 2, 4).
    (1, 5120, 2048): C(8, 1024, 8, 2, 1, False),  # qkv: 7.68; C(4, 512, 2, 4) 8.44; cuBLAS 9.34
    (1, 2048, 4096): C(8, 1024, 8, 2, 1, False),  # o: 6.85; C(4, 512, 2, 4) 7.92; cuBLAS 10.64
    (1, 128, 2048): C(8, 1024, 8, 2, 1, False),  # router: 1.83; rule 3.02; cuBLAS 5.15
}


def m_bucket(m: int) -> int:
    """The power-of-two row count (1, 2, 4, 8, 16) a launch with ``m`` rows is compiled for."""
    return 1 if m <= 1 else min(MAX_M, triton.next_power_of_2(m))


def _rule_of_thumb(mb: int, n: int, k: int, sms: int) -> SkinnyConfig:
    """Untuned default: enough programs for about two waves over the SMs, split-K when the
    feature blocks alone cannot provide them, the tensor-core product from 8 rows up."""
    dot = mb >= 8
    if dot:
        block_n, block_k, warps = 64, 128, 4
    elif mb == 1:
        block_n, block_k, warps = 16, 512, 4
    elif mb == 2:
        block_n, block_k, warps = 16, 256, 4
    else:
        block_n, block_k, warps = 16, 128, 4
    # Halve the feature block (down to 16 for the MMA, 4 otherwise) before splitting K.
    min_n = 16 if dot else 4
    while block_n > min_n and triton.cdiv(n, block_n) < 2 * sms:
        block_n //= 2
    split = 1
    while (
        triton.cdiv(n, block_n) * split < 2 * sms
        and split < 8
        and k % (block_k * split * 2) == 0
        and k // (split * 2) >= 2 * block_k
    ):
        split *= 2
    return SkinnyConfig(block_n, block_k, warps, 3, split, dot)


_RULE_CACHE: dict[tuple[int, int, int, int], SkinnyConfig] = {}


# A shape within this fraction of a measured one's N (same K and row bucket) takes its entry:
# the kernel depends on N only through the number of feature blocks. A LoRA layer whose shrink
# runs in its GEMM appends a few percent of rows (the adapters' A slots) to a tuned weight.
NEAR_N = 0.1


def _tuned_key(mb: int, n: int, k: int) -> tuple[int, int, int] | None:
    """The ``TUNED`` key for this shape: its own, else the nearest measured N within
    ``NEAR_N`` (same K and row bucket); None when there is none."""
    key = (mb, n, k)
    return key if key in TUNED else _nearest_tuned(mb, n, k)


@functools.lru_cache(maxsize=1024)
def _nearest_tuned(mb: int, n: int, k: int) -> tuple[int, int, int] | None:
    near = [t for t in TUNED if t[0] == mb and t[2] == k and abs(t[1] - n) <= NEAR_N * t[1]]
    return min(near, key=lambda t: abs(t[1] - n)) if near else None


def prefers_cublas(m: int, n: int, k: int) -> bool:
    """Whether ``linear`` leaves this shape to cuBLAS: measured faster there (``TUNED`` maps it,
    or the measured shape nearest to it, to None), or an unmeasured shape of more than one
    row."""
    mb = m_bucket(m)
    key = _tuned_key(mb, n, k)
    if key is not None:
        return TUNED[key] is None
    return mb > 1


def config_for(m: int, n: int, k: int, sms: int = SM_COUNT_FALLBACK) -> SkinnyConfig:
    """The configuration the skinny kernel launches for ``m`` rows, ``n`` features, ``k``
    inputs (the measured one, else the rule of thumb)."""
    mb = m_bucket(m)
    tuned = _tuned_key(mb, n, k)
    cfg = TUNED[tuned] if tuned is not None else None
    if cfg is None:
        key = (mb, n, k, sms)
        cfg = _RULE_CACHE.get(key)
        if cfg is None:
            cfg = _RULE_CACHE[key] = _rule_of_thumb(mb, n, k, sms)
    return cfg


def candidate_configs(m: int, n: int, k: int) -> list[SkinnyConfig]:
    """Configurations the benchmark sweeps for one shape (those whose split fits K)."""
    mb = m_bucket(m)
    cands: list[SkinnyConfig] = []
    if mb <= 4:
        bk = {1: 512, 2: 256, 4: 128}[mb]
        cands += [
            C(16, bk, 4, 3),
            C(8, bk, 4, 3),
            C(32, bk // 2, 4, 3),
            C(8, 2 * bk, 8, 2),
            C(4, bk, 2, 4),
            C(8, bk, 4, 3, split_k=2),
            C(16, bk, 4, 3, split_k=4),
        ]
    if mb >= 4:
        cands += [
            C(64, 128, 4, 3, dot=True),
            C(32, 128, 4, 4, dot=True),
            C(16, 256, 4, 3, dot=True),
            C(128, 128, 4, 3, dot=True),
            C(64, 128, 4, 3, split_k=2, dot=True),
            C(32, 256, 4, 3, split_k=4, dot=True),
        ]
    if mb == 8:
        cands.append(C(8, 128, 4, 3))
    fits = [c for c in cands if k % (c.block_k * c.split_k) == 0 and k >= c.block_k * c.split_k]
    chosen = config_for(m, n, k)
    out = fits or cands
    if chosen not in out:
        out.append(chosen)
    return out


# M changes every step: unspecialized, so M = 1 or 16 compile no variants of their own (the
# BLOCK_M bucket is the compile-time row count). Strides and sizes are fixed per layer.
@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,
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
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Clamped indices: the padding rows/features re-read a valid row; dropped at the store.
    rows_c = tl.minimum(rows, M - 1)
    cols_c = tl.minimum(cols, N - 1)
    x_rows = x_ptr + rows_c.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    w_rows = w_ptr + cols_c.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    kk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    if PREFETCH:  # one row, whole K tiles, PDL: the first weight tile loads before the wait
        w_first = pdl_prefetch_wait(w_rows + (k_lo + kk)[None, :], USE_PDL)
    else:
        pdl_wait(USE_PDL)

    if DOT:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # y^T: W is the MMA's A
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs = k0 + kk
            if EVEN_K:
                w = tl.load(w_rows + offs[None, :])
                x = tl.load(x_rows + offs[None, :])
            else:
                k_ok = offs < k_hi
                w = tl.load(w_rows + offs[None, :], mask=k_ok[None, :], other=0.0)
                x = tl.load(x_rows + offs[None, :], mask=k_ok[None, :], other=0.0)
            acc_t = tl.dot(w, tl.trans(x), acc_t, input_precision=PRECISION)
        acc = tl.trans(acc_t)  # [BLOCK_M, BLOCK_N]
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
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols_c).to(tl.float32)[None, :]
        tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials [SPLIT_K, M, N] float32; the last program of this feature block sums them.
        ws_offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(ws_ptr + pid_k * M * N + ws_offs, acc, mask=out_mask)
        # Every warp's partial stores precede the (single-thread) release of the arrival.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            tl.atomic_xchg(counter_ptr + pid_n, 0)  # ready for the next launch
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(
                    ws_ptr + s * M * N + ws_offs, mask=out_mask, other=0.0, cache_modifier=".cg"
                )
            if HAS_BIAS:
                total += tl.load(b_ptr + cols_c).to(tl.float32)[None, :]
            tl.store(y_ptr + y_offs, total.to(y_ptr.dtype.element_ty), mask=out_mask)


class _Scratch:
    """Per-device split-K workspace (float32) and arrival counters (int32, kept zeroed by the
    kernel). Grown, never shrunk or freed: captured graphs keep pointing at old buffers."""

    def __init__(self) -> None:
        self.ws: dict[torch.device, torch.Tensor] = {}
        self.counters: dict[torch.device, torch.Tensor] = {}
        self._keep: list[torch.Tensor] = []

    def get(self, device: torch.device, ws_numel: int, n_counters: int):
        ws = self.ws.get(device)
        if ws is None or ws.numel() < ws_numel:
            if ws is not None:
                self._keep.append(ws)
            ws = torch.empty(max(ws_numel, 1 << 20), dtype=torch.float32, device=device)
            self.ws[device] = ws
        cnt = self.counters.get(device)
        if cnt is None or cnt.numel() < n_counters:
            if cnt is not None:
                self._keep.append(cnt)
            cnt = torch.zeros(max(n_counters, 1 << 14), dtype=torch.int32, device=device)
            self.counters[device] = cnt
        return ws, cnt


_SCRATCH = _Scratch()
_SM_COUNT: dict[torch.device, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return SM_COUNT_FALLBACK
    if device not in _SM_COUNT:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        _SM_COUNT[device] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[device]


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` with the skinny kernel, no dispatch checks beyond shapes.

    x: [M, K] with 1 <= M <= 16 and unit stride along K; weight: [N, K] with unit stride along
    K; bias: [N] or None. Returns a new [M, N] tensor in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    assert 1 <= m <= MAX_M and weight.shape[1] == k, (x.shape, weight.shape)
    assert x.stride(1) == 1 and weight.stride(1) == 1
    cfg = config or config_for(m, n, k, _sm_count(x.device))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 16 if cfg.dot else m_bucket(m)
    split = max(1, cfg.split_k)
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    grid_n = triton.cdiv(n, cfg.block_n)
    if split > 1:
        ws, counters = _SCRATCH.get(x.device, split * m * n, grid_n)
    else:
        ws, counters = y, y  # unused
    if bias is not None:
        bias = bias if bias.stride(0) == 1 else bias.contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    even_k = k % (cfg.block_k * split) == 0
    launch = pdl_launch(x.device)
    _skinny_kernel[(grid_n, split)](
        x,
        weight,
        bias if bias is not None else y,
        y,
        ws,
        counters,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split,
        DOT=cfg.dot,
        HAS_BIAS=bias is not None,
        EVEN_K=even_k,
        PRECISION=precision,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        PREFETCH=pdl.PREFETCH_WEIGHTS and bool(launch) and block_m == 1 and not cfg.dot and even_k,
        **launch,
    )
    return y


def use_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The dispatch rule of ``linear``: 2-D bf16/fp16 CUDA input of 1..16 rows, a weight of the
    same dtype with unit stride along K (and a matching bias)."""
    return (
        x.dim() == 2
        and 1 <= x.shape[0] <= MAX_M
        and x.dtype in DTYPES
        and x.device.type in DEVICE_TYPES
        and x.stride(1) == 1
        and weight.dim() == 2
        and weight.dtype == x.dtype
        and weight.device == x.device
        and weight.shape[1] == x.shape[1]
        and weight.stride(1) == 1
        and (bias is None or (bias.dtype == x.dtype and bias.shape == (weight.shape[0],)))
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``torch.nn.functional.linear``, through the skinny kernel for decode-sized inputs."""
    if use_skinny(x, weight, bias) and not prefers_cublas(x.shape[0], *weight.shape):
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)
