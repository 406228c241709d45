"""Paged attention in Triton: varlen prefill / chunked prefill, and split-KV decode.

Both kernels read keys and values from the paged cache
``[2, num_blocks, page, num_kv_heads, head_size]`` through each request's block table, so a
prefill chunk attends over its cached prefix and its own (just written) tokens alike.

Conventions (``engine.attention_backends.interface``): request ``i`` owns query tokens
``query_start_loc[i]:query_start_loc[i+1]``; its context is ``seq_lens[i]`` tokens, the last
``query_len`` of which are the queries, so query ``t`` sits at position
``seq_len - query_len + t``. Query at ``p`` sees key ``j`` iff ``j <= p`` and ``p - j < window``.
Soft-capping maps the scaled score ``s`` to ``cap * tanh(s / cap)``.

GQA: one program serves all ``G = num_heads // num_kv_heads`` query heads that share a KV head,
so every key/value tile is loaded once for the whole group. In the prefill kernel a tile row is
one (token, head-in-group) pair: ``BLOCK_M`` rows hold ``BLOCK_M // G`` tokens.

Decode (flash-decoding): the grid is ``(requests, kv_heads, splits)``; each program reduces one
slice of the context to a partial output and a log-sum-exp, and a second kernel combines the
slices. ``splits`` depends only on the batch size and head count, and every length is read from
device tensors, so the launch can be captured in a CUDA graph and replayed with new lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _scores(q, k, scale, softcap, USE_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """Scaled (and soft-capped) scores in the log2 domain: ``[rows, keys]`` float32."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if USE_SOFTCAP:
        s = softcap * _tanh(s / softcap)
    return s * 1.4426950408889634


@triton.jit
def _load_kv_tile(
    cache_ptr, bt_row_ptr, n, n_mask, kv_head, stride_blk, stride_tok, stride_head, d, d_mask,
    PAGE: tl.constexpr,
):  # fmt: skip
    """Gather ``[BLOCK_N, HEAD_PAD]`` rows of one cache half for token positions ``n``."""
    page = tl.load(bt_row_ptr + n // PAGE, mask=n_mask, other=0).to(tl.int64)
    off = page * stride_blk + (n % PAGE).to(tl.int64) * stride_tok + kv_head * stride_head
    return tl.load(cache_ptr + off[:, None] + d[None, :], mask=n_mask[:, None] & d_mask[None, :])


@triton.jit
def _find_seq(qsl_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr, SEQ_CHUNK: tl.constexpr):
    """The request owning virtual q-block ``pid``: request ``i``'s blocks start at
    ``(qsl[i] - qsl[0]) // BLOCK_Q + i``, which leaves room for all of its blocks. Counts the
    starts at or before ``pid`` (a vector compare; prefill batches hold few requests)."""
    q0 = tl.load(qsl_ptr)
    count = 0
    for c in range(0, num_seqs, SEQ_CHUNK):
        i = c + tl.arange(0, SEQ_CHUNK)
        ok = i < num_seqs
        start = (tl.load(qsl_ptr + i, mask=ok, other=0) - q0) // BLOCK_Q + i
        count += tl.sum((ok & (start <= pid)).to(tl.int32), axis=0)
    return count - 1


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    qsl_ptr,
    seq_lens_ptr,
    block_table_ptr,
    num_seqs,
    q_stride_t,
    q_stride_h,
    o_stride_t,
    o_stride_h,
    stride_blk,
    stride_tok,
    stride_head,
    bt_stride,
    scale,
    softcap,
    window,
    head_size,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // G
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(qsl_ptr, num_seqs, pid, BLOCK_Q, 32)
    q0 = tl.load(qsl_ptr)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    blk = pid - ((q_start - q0) // BLOCK_Q + seq)
    if blk * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    tok = blk * BLOCK_Q + r // G
    head = kv_head * G + r % G
    row_ok = (r < BLOCK_Q * G) & (tok < q_len)
    pos = prefix + tok
    d = tl.arange(0, HEAD_PAD)
    d_mask = d < head_size
    q_rows = (q_start + tok).to(tl.int64) * q_stride_t + head.to(tl.int64) * q_stride_h
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None] & d_mask[None, :])

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)

    pos_lo = prefix + blk * BLOCK_Q
    kv_hi = prefix + tl.minimum(q_len, (blk + 1) * BLOCK_Q)  # one past the last visible key
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(pos_lo - window + 1, 0)
        kv_lo = (kv_lo // BLOCK_N) * BLOCK_N
    bt_row = block_table_ptr + seq.to(tl.int64) * bt_stride
    for start in range(kv_lo, kv_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < kv_hi
        k = _load_kv_tile(
            k_cache_ptr, bt_row, n, n_mask, kv_head, stride_blk, stride_tok, stride_head, d,
            d_mask, PAGE,
        )  # fmt: skip
        s = _scores(q, k, scale, softcap, USE_SOFTCAP, PRECISION)
        visible = n[None, :] <= pos[:, None]
        if USE_WINDOW:
            visible = visible & (pos[:, None] - n[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_kv_tile(
            v_cache_ptr, bt_row, n, n_mask, kv_head, stride_blk, stride_tok, stride_head, d,
            d_mask, PAGE,
        )  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    o_rows = (q_start + tok).to(tl.int64) * o_stride_t + head.to(tl.int64) * o_stride_h
    tl.store(
        out_ptr + o_rows[:, None] + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_mask[None, :],
    )


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    block_table_ptr,
    q_stride_t,
    q_stride_h,
    o_stride_t,
    o_stride_h,
    stride_blk,
    stride_tok,
    stride_head,
    bt_stride,
    scale,
    softcap,
    window,
    head_size,
    num_heads,
    num_splits,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    # Each split takes a whole number of tiles; trailing splits may get nothing.
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    s_lo = lo + split * per_split
    s_hi = tl.minimum(s_lo + per_split, seq_len)

    g = tl.arange(0, G_PAD)
    head = kv_head * G + g
    g_ok = g < G
    d = tl.arange(0, HEAD_PAD)
    d_mask = d < head_size
    q_rows = seq * q_stride_t + head.to(tl.int64) * q_stride_h
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=g_ok[:, None] & d_mask[None, :])

    m_i = tl.full([G_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HEAD_PAD], tl.float32)
    bt_row = block_table_ptr + seq * bt_stride
    for start in range(s_lo, s_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < s_hi
        k = _load_kv_tile(
            k_cache_ptr, bt_row, n, n_mask, kv_head, stride_blk, stride_tok, stride_head, d,
            d_mask, PAGE,
        )  # fmt: skip
        s = _scores(q, k, scale, softcap, USE_SOFTCAP, PRECISION)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_kv_tile(
            v_cache_ptr, bt_row, n, n_mask, kv_head, stride_blk, stride_tok, stride_head, d,
            d_mask, PAGE,
        )  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if not SPLIT_KV:
        o_rows = seq * o_stride_t + head.to(tl.int64) * o_stride_h
        tl.store(
            out_ptr + o_rows[:, None] + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None] & d_mask[None, :],
        )
    else:
        # Partials: [B, num_heads, MAX_SPLITS, HEAD_PAD], log2-sum-exp [B, num_heads, MAX_SPLITS].
        idx = (seq * num_heads + head) * MAX_SPLITS + split
        tl.store(part_out_ptr + idx[:, None] * HEAD_PAD + d[None, :], out, mask=g_ok[:, None])
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(part_lse_ptr + idx, lse, mask=g_ok)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    o_stride_t,
    o_stride_h,
    num_heads,
    head_size,
    num_splits,
    MAX_SPLITS: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (seq * num_heads + head) * MAX_SPLITS
    sp = tl.arange(0, MAX_SPLITS)
    sp_ok = sp < num_splits
    lse = tl.load(part_lse_ptr + base + sp, mask=sp_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    total = tl.sum(w, axis=0)
    d = tl.arange(0, HEAD_PAD)
    parts = tl.load(
        part_out_ptr + (base + sp)[:, None] * HEAD_PAD + d[None, :], mask=sp_ok[:, None]
    )
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + seq * o_stride_t + head * o_stride_h + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < head_size,
    )


def _interpreted(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _precision(dtype: torch.dtype) -> str:
    # float32 models are for exactness tests: keep the dot products in full float32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _cache_halves(kv_cache: torch.Tensor):
    k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, page, kv_heads, head_size]
    assert k_cache.stride(-1) == 1
    return k_cache, v_cache


def paged_prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_seqs: int,
    num_tokens: int,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> None:
    """Attention for ``num_seqs`` requests with query lengths from ``query_start_loc`` (absolute
    token indices into ``query``/``out`` [T, H, D]) over their paged context; writes ``out``.
    ``num_tokens`` (the tokens these requests own) only sizes the grid."""
    if num_seqs == 0 or num_tokens == 0:
        return
    num_heads, head_size = query.shape[1], query.shape[2]
    k_cache, v_cache = _cache_halves(kv_cache)
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    interp = _interpreted(query)
    block_m = 16 if interp else 128
    block_m = max(block_m, triton.next_power_of_2(group))
    block_n = 16 if interp else 64
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        query_start_loc,
        seq_lens,
        block_table,
        num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_table.stride(0),
        scale,
        logit_softcap or 0.0,
        sliding_window or 0,
        head_size,
        G=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PAGE=page,
        HEAD_PAD=max(16, triton.next_power_of_2(head_size)),
        USE_WINDOW=bool(sliding_window),
        USE_SOFTCAP=bool(logit_softcap),
        PRECISION=_precision(query.dtype),
        num_warps=4 if interp else 8,
        num_stages=1 if interp else 3,
    )


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


MAX_SPLITS = 32


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """How many context slices each (request, KV head) gets: enough programs to fill the GPU
    about twice over. A function of the batch shape only, so graph replays stay valid."""
    programs = num_seqs * num_kv_heads
    want = triton.cdiv(2 * _num_sms(device), max(programs, 1))
    return max(1, min(MAX_SPLITS, triton.next_power_of_2(want)))


def paged_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_seqs: int,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    num_splits: int | None = None,
) -> None:
    """One query token per request (request ``i`` is token ``i`` of ``query``/``out``
    [T, H, D]) over its paged context of ``seq_lens[i]`` tokens. Writes ``out[:num_seqs]``."""
    if num_seqs == 0:
        return
    num_heads, head_size = query.shape[1], query.shape[2]
    k_cache, v_cache = _cache_halves(kv_cache)
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    interp = _interpreted(query)
    if num_splits is None:
        num_splits = decode_splits(num_seqs, num_kv_heads, query.device)
    head_pad = max(16, triton.next_power_of_2(head_size))
    num_splits = min(num_splits, MAX_SPLITS)
    if num_splits > 1:
        part_out = torch.empty(
            (num_seqs, num_heads, MAX_SPLITS, head_pad), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            (num_seqs, num_heads, MAX_SPLITS), dtype=torch.float32, device=query.device
        )
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        seq_lens,
        block_table,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_table.stride(0),
        scale,
        logit_softcap or 0.0,
        sliding_window or 0,
        head_size,
        num_heads,
        num_splits,
        G=group,
        G_PAD=max(16, triton.next_power_of_2(group)),
        SPLIT_KV=num_splits > 1,
        MAX_SPLITS=MAX_SPLITS,
        BLOCK_N=16 if interp else 64,
        PAGE=page,
        HEAD_PAD=head_pad,
        USE_WINDOW=bool(sliding_window),
        USE_SOFTCAP=bool(logit_softcap),
        PRECISION=_precision(query.dtype),
        num_warps=4,
        num_stages=1 if interp else 3,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            head_size,
            num_splits,
            MAX_SPLITS=MAX_SPLITS,
            HEAD_PAD=head_pad,
            num_warps=4,
        )
