"""Multi-LoRA for a batch of mixed adapters: one shrink and one expand launch per projection.

``add_lora_linear(y, x, lora_a, lora_b, token_slots, sorted_tokens, slot_starts, slice_sizes)``
adds, for every token with an adapter slot, ``(x @ A_slot^T) @ B_slot^T`` to each output slice
of ``y`` in place (the spec: ``engine.kernels.reference.add_lora_linear``). The punica scheme:

* **shrink** ``s[t] = x[t] @ A[slot(t)]^T`` (``[T, S*R]`` float32; the fused slices' A
  matrices are stacked, so q, k and v shrink in one product). A *tile* is up to ``BLOCK_M``
  consecutive tokens of one slot in the slot-grouped token list (``sorted_tokens`` /
  ``slot_starts``), so a program's product is a plain GEMM of the gathered rows against that
  slot's A, on tensor cores. The slots' tiles are numbered one after the other and each
  program finds its slot from ``slot_starts`` (one vector load and a prefix sum); the grid holds
  ``cdiv(T, BLOCK_M) + min(slots, T)`` tiles, the most any mapping of ``T`` tokens needs, so its
  shape depends on ``T`` and the slot count only (a captured CUDA graph serves any mapping)
  and programs past the step's tiles exit at once.
  Decode batches have few tokens per slot and a long K: K is split, each split writes a float32
  partial to a workspace and bumps an arrival counter, and the last program of a tile sums the
  partials (the scheme of ``engine_triton.kernels.linear``: one launch, no memset, graph-safe).
* **expand** ``y[t, slice s] += s[t, s*R:(s+1)*R] @ B[slot(t), slice s]^T``: grid
  ``(tiles x feature blocks of every slice)``; a feature block lies in one slice (the
  blocks of each slice are numbered one after the other), so one launch writes every slice's
  part of the fused q/k/v or gate/up output. The shrunk values are rounded to the activation
  dtype for the product (float32 models keep float32, in IEEE precision); ``y`` is read, the
  product added in float32 and written once.

Rows of tokens without an adapter are neither read nor written. ``x``, ``A`` and ``B`` share
the activation dtype (bfloat16, float16 or float32).

``lora_expand_augmented`` is the expand alone, for layers whose base GEMM computed every slot's
shrink (``x @ [W; A_0; ...]^T``, see ``engine.lora.layers``): one launch over every token,
slot-grouped tiles as above and then the tiles of the tokens without an adapter, writing a
fresh ``[T, N]`` (base part plus the token's slot's expand; the base part alone for the
others).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_SLICES = 3
# The last arriver of a split tile sums the partials in an unrolled loop: few, bounded splits.
MAX_SPLIT_K = 16
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SM_COUNT_FALLBACK = 132


@triton.jit
def _find_tile(
    starts_ptr,
    tile,
    T,
    NUM_SLOTS,
    SLOTS_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    WITH_NONE: tl.constexpr,
):
    """``(slot, first row, end row)`` in the slot-grouped token list of tile number ``tile``
    (the slots' tiles numbered in slot order; with ``WITH_NONE`` the tiles of the tokens
    without an adapter come last, as slot ``NUM_SLOTS``); slot -1 past the last tile. Two
    vector loads of ``slot_starts`` and a prefix sum: no serial chain of loads."""
    lanes = tl.arange(0, SLOTS_P2)
    valid = lanes < NUM_SLOTS + WITH_NONE
    lo = tl.load(starts_ptr + lanes, mask=lanes <= NUM_SLOTS, other=0)
    hi = tl.load(starts_ptr + lanes + 1, mask=lanes < NUM_SLOTS, other=0)
    hi = tl.where(lanes == NUM_SLOTS, T, hi)
    tiles = tl.where(valid, tl.cdiv(hi - lo, BLOCK_M), 0)
    last = tl.cumsum(tiles, axis=0)  # one past each slot's last tile
    hit = valid & (tile >= last - tiles) & (tile < last)
    slot = tl.max(tl.where(hit, lanes, -1), axis=0)
    row = tl.sum(tl.where(hit, lo + (tile - (last - tiles)) * BLOCK_M, 0), axis=0)
    end = tl.sum(tl.where(hit, hi, 0), axis=0)
    return slot, row, end


# T changes every step: a runtime value, so a graph capture over many batch sizes compiles a
# handful of variants (tile shape x split), not one per size.
@triton.jit(do_not_specialize=["T"])
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    ws_ptr,
    counter_ptr,
    sorted_ptr,
    starts_ptr,
    T,
    N,
    K,
    K_PER_SPLIT,
    NUM_SLOTS,
    stride_xt,
    stride_al,
    stride_an,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    SLOTS_P2: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_k = pid % SPLIT_K
    pid_mn = pid // SPLIT_K
    pid_n = pid_mn % num_n
    tile = pid_mn // num_n
    slot, m0, end = _find_tile(starts_ptr, tile, T, NUM_SLOTS, SLOTS_P2, BLOCK_M, 0)
    if slot >= 0:
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        # Rows past the slot's tokens read token 0 (a valid row); dropped at the store.
        tok = tl.load(sorted_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols_c = tl.minimum(cols, N - 1)
        x_rows = x_ptr + tok[:, None] * stride_xt
        a_rows = a_ptr + slot.to(tl.int64) * stride_al + cols_c.to(tl.int64)[:, None] * stride_an
        kk = tl.arange(0, BLOCK_K)
        k_lo = pid_k * K_PER_SPLIT
        k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs = k0 + kk
            if EVEN_K:
                xt = tl.load(x_rows + offs[None, :])
                at = tl.load(a_rows + offs[None, :])
            else:
                k_ok = offs < k_hi
                xt = tl.load(x_rows + offs[None, :], mask=k_ok[None, :], other=0.0)
                at = tl.load(a_rows + offs[None, :], mask=k_ok[None, :], other=0.0)
            acc = tl.dot(xt, tl.trans(at), acc, input_precision=PRECISION)
        out_offs = tok[:, None] * N + cols[None, :]
        out_mask = row_ok[:, None] & (cols < N)[None, :]
        if SPLIT_K == 1:
            tl.store(out_ptr + out_offs, acc, mask=out_mask)
        else:
            # Partials [SPLIT_K, T, N]; the last program of this (tile, n) block sums them.
            tl.store(ws_ptr + pid_k * T * N + out_offs, acc, mask=out_mask)
            tl.debug_barrier()  # every warp's partial precedes the release of the arrival
            counter = counter_ptr + tile * num_n + pid_n
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                tl.atomic_xchg(counter, 0)  # ready for the next launch
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(
                        ws_ptr + s * T * N + out_offs,
                        mask=out_mask,
                        other=0.0,
                        cache_modifier=".cg",
                    )
                tl.store(out_ptr + out_offs, total, mask=out_mask)


@triton.jit(do_not_specialize=["T"])
def _lora_expand_kernel(
    y_ptr,
    s_ptr,
    b_ptr,
    sorted_ptr,
    starts_ptr,
    T,
    R,
    N0,
    N1,
    N2,
    NB0,
    NB1,
    NB2,
    NUM_SLOTS,
    stride_yt,
    stride_st,
    stride_bl,
    stride_bn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ROUND_SHRUNK: tl.constexpr,
    PRECISION: tl.constexpr,
    SLOTS_P2: tl.constexpr,
):
    pid = tl.program_id(0)
    num_blocks = NB0 + NB1 + NB2
    pid_n = pid % num_blocks
    tile = pid // num_blocks
    slot, m0, end = _find_tile(starts_ptr, tile, T, NUM_SLOTS, SLOTS_P2, BLOCK_M, 0)
    if slot >= 0:
        # The slice this feature block lies in, and the block's place in it.
        in1 = pid_n >= NB0
        in2 = pid_n >= NB0 + NB1
        sl = in1.to(tl.int32) + in2.to(tl.int32)
        first_block = tl.where(in2, NB0 + NB1, tl.where(in1, NB0, 0))
        offset = tl.where(in2, N0 + N1, tl.where(in1, N0, 0))
        size = tl.where(in2, N2, tl.where(in1, N1, N0))
        local = (pid_n - first_block) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = local < size
        # Masked, not clamped: a clamp hides the columns' contiguity from the compiler, which
        # then moves y element by element.
        cols = offset + local
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        tok = tl.load(sorted_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        r = tl.arange(0, BLOCK_R)
        r_ok = r < R
        shrunk = tl.load(
            s_ptr + tok[:, None] * stride_st + sl * R + r[None, :],
            mask=row_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr
            + slot.to(tl.int64) * stride_bl
            + cols.to(tl.int64)[:, None] * stride_bn
            + r[None, :],
            mask=col_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        if ROUND_SHRUNK:
            acc = tl.dot(shrunk.to(b.dtype), tl.trans(b))
        else:
            acc = tl.dot(shrunk, tl.trans(b.to(tl.float32)), input_precision=PRECISION)
        y_ptrs = y_ptr + tok[:, None] * stride_yt + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T"])
def _lora_expand_augmented_kernel(
    out_ptr,
    yaug_ptr,
    b_ptr,
    sorted_ptr,
    starts_ptr,
    T,
    R,
    N0,
    N1,
    N2,
    NB0,
    NB1,
    NB2,
    NUM_SLOTS,
    WIDTH,
    stride_ot,
    stride_yt,
    stride_bl,
    stride_bn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ROUND_SHRUNK: tl.constexpr,
    PRECISION: tl.constexpr,
    SLOTS_P2: tl.constexpr,
):
    """out[t, cols] = y_aug[t, cols] (+ the expand of token t's slot, whose shrunk values
    are y_aug's columns N + slot*WIDTH ...): every token is written, the tokens without an
    adapter (the tiles after the slots') with their base row only."""
    pid = tl.program_id(0)
    num_blocks = NB0 + NB1 + NB2
    pid_n = pid % num_blocks
    tile = pid // num_blocks
    slot, m0, end = _find_tile(starts_ptr, tile, T, NUM_SLOTS, SLOTS_P2, BLOCK_M, 1)
    if slot >= 0:
        in1 = pid_n >= NB0
        in2 = pid_n >= NB0 + NB1
        sl = in1.to(tl.int32) + in2.to(tl.int32)
        first_block = tl.where(in2, NB0 + NB1, tl.where(in1, NB0, 0))
        offset = tl.where(in2, N0 + N1, tl.where(in1, N0, 0))
        size = tl.where(in2, N2, tl.where(in1, N1, N0))
        local = (pid_n - first_block) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = local < size
        # Masked, not clamped: a clamp hides the columns' contiguity from the compiler, which
        # then moves y element by element.
        cols = offset + local
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        tok = tl.load(sorted_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        mask = row_ok[:, None] & col_ok[None, :]
        acc = tl.load(yaug_ptr + tok[:, None] * stride_yt + cols[None, :], mask=mask, other=0.0)
        acc = acc.to(tl.float32)
        if slot < NUM_SLOTS:
            r = tl.arange(0, BLOCK_R)
            r_ok = r < R
            first = N0 + N1 + N2 + slot * WIDTH + sl * R
            shrunk = tl.load(
                yaug_ptr + tok[:, None] * stride_yt + first + r[None, :],
                mask=row_ok[:, None] & r_ok[None, :],
                other=0.0,
            )
            b = tl.load(
                b_ptr
                + slot.to(tl.int64) * stride_bl
                + cols.to(tl.int64)[:, None] * stride_bn
                + r[None, :],
                mask=col_ok[:, None] & r_ok[None, :],
                other=0.0,
            )
            if ROUND_SHRUNK:
                acc += tl.dot(shrunk, tl.trans(b))
            else:
                acc += tl.dot(
                    shrunk.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision=PRECISION
                )
        tl.store(
            out_ptr + tok[:, None] * stride_ot + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=mask,
        )


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
            ws = torch.empty(max(ws_numel, 1 << 18), dtype=torch.float32, device=device)
            self.ws[device] = ws
        cnt = self.counters.get(device)
        if cnt is None or cnt.numel() < n_counters:
            if cnt is not None:
                self._keep.append(cnt)
            cnt = torch.zeros(max(n_counters, 1 << 12), dtype=torch.int32, device=device)
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


def _precision(dtype: torch.dtype) -> str:
    """float32 products in IEEE precision (float32 models stay exact); 16-bit operands ignore
    it on CUDA (tf32, as the other kernels pass), and ROCm's Triton allows no "tf32"."""
    return "ieee" if dtype == torch.float32 or torch.version.hip else "tf32"


def _slots_p2(num_slots: int) -> int:
    return max(2, triton.next_power_of_2(num_slots))


def max_tiles(num_tokens: int, block_m: int, num_slots: int) -> int:
    """The most tiles ``num_tokens`` tokens over ``num_slots`` slots can need: every slot's
    last tile may be partial."""
    return triton.cdiv(num_tokens, block_m) + min(num_slots, num_tokens)


def block_m_for(num_tokens: int, num_slots: int) -> int:
    """Tokens per tile: sized for the tokens one slot gets when a batch spreads evenly."""
    per_slot = triton.cdiv(num_tokens, max(1, min(num_slots, num_tokens)))
    return 16 if per_slot <= 16 else 32 if per_slot <= 32 else 64


@functools.lru_cache(maxsize=4096)
def shrink_config(
    num_tokens: int, n: int, k: int, num_slots: int, sms: int = SM_COUNT_FALLBACK
) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)`` of the shrink: split K (a power of two, at most
    ``MAX_SPLIT_K``) until the expected busy programs cover about two waves of the SMs, each
    split keeping at least two K blocks."""
    block_m = block_m_for(num_tokens, num_slots)
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = 128 if block_m <= 32 else 64
    slots = max(1, min(num_slots, num_tokens))
    busy = slots * triton.cdiv(triton.cdiv(num_tokens, slots), block_m) * triton.cdiv(n, block_n)
    split = 1
    while busy * split < 2 * sms and split < MAX_SPLIT_K and k >= 4 * block_k * split:
        split *= 2
    return block_m, block_n, block_k, split


@functools.lru_cache(maxsize=4096)
def expand_config(num_tokens: int, num_slots: int) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)`` of the expand."""
    block_m = block_m_for(num_tokens, num_slots)
    return block_m, 128 if block_m <= 32 else 64


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    sorted_tokens: torch.Tensor,
    slot_starts: torch.Tensor,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``x[t] @ lora_a[slot(t)]^T`` for the tokens with a slot: float32 ``[T, S*R]`` (rows of
    tokens without a slot are left unwritten)."""
    t, k = x.shape
    num_slots, n = lora_a.shape[0], lora_a.shape[1]
    out = torch.empty((t, n), dtype=torch.float32, device=x.device)
    block_m, block_n, block_k, split = config or shrink_config(
        t, n, k, num_slots, _sm_count(x.device)
    )
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    tiles, n_tiles = max_tiles(t, block_m, num_slots), triton.cdiv(n, block_n)
    if split > 1:
        ws, counters = _SCRATCH.get(x.device, split * t * n, tiles * n_tiles)
    else:
        ws = counters = out  # unused
    _lora_shrink_kernel[(tiles * n_tiles * split,)](
        x,
        lora_a,
        out,
        ws,
        counters,
        sorted_tokens,
        slot_starts,
        t,
        n,
        k,
        k_per_split,
        num_slots,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split,
        EVEN_K=k % (block_k * split) == 0,
        PRECISION=_precision(x.dtype),
        SLOTS_P2=_slots_p2(num_slots),
        num_warps=4,
        num_stages=3,
    )
    return out


def lora_expand(
    y: torch.Tensor,
    shrunk: torch.Tensor,
    lora_b: torch.Tensor,
    sorted_tokens: torch.Tensor,
    slot_starts: torch.Tensor,
    slice_sizes: tuple[int, ...],
    config: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``y[t, slice s] += shrunk[t, s*R:(s+1)*R] @ lora_b[slot(t), slice s]^T`` in place."""
    t = y.shape[0]
    num_slots, _, rank = lora_b.shape
    block_m, block_n = config or expand_config(t, num_slots)
    sizes = list(slice_sizes) + [0] * (MAX_SLICES - len(slice_sizes))
    blocks = [triton.cdiv(s, block_n) for s in sizes]
    _lora_expand_kernel[(max_tiles(t, block_m, num_slots) * sum(blocks),)](
        y,
        shrunk,
        lora_b,
        sorted_tokens,
        slot_starts,
        t,
        rank,
        *sizes,
        *blocks,
        num_slots,
        y.stride(0),
        shrunk.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        ROUND_SHRUNK=y.dtype != torch.float32,
        PRECISION="ieee",
        SLOTS_P2=_slots_p2(num_slots),
        num_warps=4,
        num_stages=2,
    )
    return y


def lora_expand_augmented(
    y_aug: torch.Tensor,
    out_features: int,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    sorted_tokens: torch.Tensor,
    slot_starts: torch.Tensor,
    slice_sizes: tuple[int, ...],
) -> torch.Tensor:
    """The registered op for layers whose base GEMM computed the shrink (the spec:
    ``engine.kernels.reference.lora_expand_augmented``): one launch over every token."""
    t = y_aug.shape[0]
    num_slots, n, rank = lora_b.shape
    if (
        not 1 <= len(slice_sizes) <= MAX_SLICES
        or y_aug.dim() != 2
        or y_aug.dtype not in DTYPES
        or lora_b.dtype != y_aug.dtype
        or y_aug.stride(1) != 1
        or not lora_b.is_contiguous()
    ):
        from engine.kernels.reference import lora_expand_augmented as reference

        return reference(
            y_aug, out_features, lora_b, token_slots, sorted_tokens, slot_starts, slice_sizes
        )
    out = torch.empty((t, out_features), dtype=y_aug.dtype, device=y_aug.device)
    if t == 0:
        return out
    block_m, block_n = expand_config(t, num_slots)
    sizes = list(slice_sizes) + [0] * (MAX_SLICES - len(slice_sizes))
    blocks = [triton.cdiv(s, block_n) for s in sizes]
    tiles = max_tiles(t, block_m, num_slots) + 1  # + the last tile of the tokens without one
    _lora_expand_augmented_kernel[(tiles * sum(blocks),)](
        out,
        y_aug,
        lora_b,
        sorted_tokens,
        slot_starts,
        t,
        rank,
        *sizes,
        *blocks,
        num_slots,
        len(slice_sizes) * rank,
        out.stride(0),
        y_aug.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        ROUND_SHRUNK=y_aug.dtype != torch.float32,
        PRECISION="ieee",
        SLOTS_P2=_slots_p2(num_slots + 1),
        num_warps=4,
        num_stages=2,
    )
    return out


def supported(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> bool:
    """Shapes and dtypes the kernels take (the reference serves the rest)."""
    return (
        x.dim() == 2
        and y.dim() == 2
        and x.dtype in DTYPES
        and lora_a.dtype == x.dtype
        and lora_b.dtype == x.dtype
        and y.dtype == x.dtype
        and x.stride(1) == 1
        and y.stride(1) == 1
        and lora_a.is_contiguous()
        and lora_b.is_contiguous()
    )


def add_lora_linear(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    sorted_tokens: torch.Tensor,
    slot_starts: torch.Tensor,
    slice_sizes: tuple[int, ...],
) -> torch.Tensor:
    """The registered op (see the module docstring): one shrink and one expand launch."""
    if not 1 <= len(slice_sizes) <= MAX_SLICES or not supported(y, x, lora_a, lora_b):
        from engine.kernels.reference import add_lora_linear as reference

        return reference(y, x, lora_a, lora_b, token_slots, sorted_tokens, slot_starts, slice_sizes)
    if x.shape[0] == 0:
        return y
    shrunk = lora_shrink(x, lora_a, sorted_tokens, slot_starts)
    return lora_expand(y, shrunk, lora_b, sorted_tokens, slot_starts, tuple(slice_sizes))
