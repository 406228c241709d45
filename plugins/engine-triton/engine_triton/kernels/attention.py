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
slice of the context (a whole number of tiles) to a partial output and a log-sum-exp, and the
last program of each (request, KV head) to finish (an atomic arrival counter) combines the
slices, all G heads of the group at once, so one launch does it all. A context shorter than the
splits fills only the first few (the rest exit at once) and is combined over those; one that
fits in a single slice is written without a combine. The same launch also appends each
request's newest key/value to the cache. ``splits`` depends only on the batch size and head
count, and every length is read from device tensors, so the launch can be captured in a CUDA
graph and replayed with new lengths.

Attention sinks (GPT-OSS; ``sinks``: float32 ``[num_heads]``, see ``interface.py``): query head
``h``'s softmax denominator also holds ``exp(sinks[h])``. Every kernel keeps its running max and
sum over the keys only and folds the sink in once, where a query's answer is final: at the end
of the prefill kernel, of an unsplit decode, or of the split-KV combine (after the splits' and
the shared prefix's partials are merged). Partials (split-KV slices, cascade's shared pass)
never hold it, so however a context is cut the sink counts once. Without sinks the
``HAS_SINKS`` branches are compiled out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_triton.kernels.kv_cache import _to_fp8
from engine_triton.kernels.pdl import pdl_launch, pdl_wait

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
def _sink_scale(sinks_ptr, head, mask, m_i, l_i):
    """Attention sinks: the factor ``L / (L + e^sink)`` (``L = l_i * 2^m_i``, the softmax
    denominator over the keys, log2 domain) that turns outputs normalised over the keys into
    outputs whose denominator also holds query head ``head``'s sink, in float32. Written as
    ``1 / (1 + 2^(sink - lse))``, relative to the keys' log-sum-exp, so neither a large sink
    nor a large score overflows (a sink far above the scores gives 0, the limit). A row that
    saw no key (``l_i == 0``: a padding row, whose output is 0 anyway) gets 1/2, never NaN."""
    sink = tl.load(sinks_ptr + head, mask=mask, other=0.0) * 1.4426950408889634
    has_keys = l_i > 0.0
    lse = m_i + tl.log2(tl.where(has_keys, l_i, 1.0))
    return 1.0 / (1.0 + tl.exp2(tl.where(has_keys, sink - lse, 0.0)))


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
def _attend_tile(
    q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row, n, n_mask, visible, kv_head, stride_blk,
    stride_tok, stride_head, d, d_mask, scale, softcap, USE_SOFTCAP: tl.constexpr,
    PAGE: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """One key/value tile of online-softmax attention: scores of ``q`` against the cached keys
    at positions ``n`` (``visible``: [rows, keys] or [1, keys] mask), folded into the running
    max ``m_i``, sum ``l_i`` and output ``acc`` (log2 domain). Returns the three updated.

    An FP8 cache's tiles are converted to the query dtype (exact); its scales are folded into
    ``scale`` (the key scale) and into the final output (the value scale) by the caller."""
    k = _load_kv_tile(
        k_cache_ptr, bt_row, n, n_mask, kv_head, stride_blk, stride_tok, stride_head, d, d_mask,
        PAGE,
    )  # fmt: skip
    if KV_FP8:
        k = k.to(q.dtype)
    s = _scores(q, k, scale, softcap, USE_SOFTCAP, PRECISION)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = _load_kv_tile(
        v_cache_ptr, bt_row, n, n_mask, kv_head, stride_blk, stride_tok, stride_head, d, d_mask,
        PAGE,
    )  # fmt: skip
    if KV_FP8:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


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


# Arguments that change from step to step are not specialized: Triton would otherwise compile a
# new variant whenever an integer first becomes 1 or a multiple of 16, or a pointer (the
# metadata sliced past the decodes) first lands off a 16-byte boundary; each compile costs about
# a second in the middle of serving (measured: 7.8k -> 17.6k output tok/s on the H200).
# ``sinks_ptr`` is such a slice too when there are no sinks (it then stands in, unused).
@triton.jit(
    do_not_specialize=["num_seqs", "bt_stride"],
    do_not_specialize_on_alignment=["qsl_ptr", "seq_lens_ptr", "block_table_ptr", "sinks_ptr"],
)
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
    v_scale,
    sinks_ptr,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // G
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(qsl_ptr, num_seqs, pid, BLOCK_Q, 32)
    q0 = tl.load(qsl_ptr)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    blk = pid - ((q_start - q0) // BLOCK_Q + seq)
    # Programs past the request's last q-block (the grid over-counts) do nothing: no rows, no
    # key tiles (no early return, which not every Triton lowers).
    has_rows = blk * BLOCK_Q < q_len
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    tok = blk * BLOCK_Q + r // G
    head = kv_head * G + r % G
    row_ok = (r < BLOCK_Q * G) & (tok < q_len) & has_rows
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
    kv_hi = tl.where(has_rows, kv_hi, 0)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(pos_lo - window + 1, 0)
        kv_lo = (kv_lo // BLOCK_N) * BLOCK_N
    bt_row = block_table_ptr + seq.to(tl.int64) * bt_stride
    for start in range(kv_lo, kv_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < kv_hi
        visible = n[None, :] <= pos[:, None]
        if USE_WINDOW:
            visible = visible & (pos[:, None] - n[None, :] < window)
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row, n, n_mask, visible, kv_head,
            stride_blk, stride_tok, stride_head, d, d_mask, scale, softcap, USE_SOFTCAP, PAGE,
            PRECISION, KV_FP8,
        )  # fmt: skip

    if HAS_SINKS:  # one pass over all of the query's keys: its answer is final here
        acc = acc * _sink_scale(sinks_ptr, head, row_ok, m_i, l_i)[:, None]
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    if KV_FP8:
        out = out * v_scale
    o_rows = (q_start + tok).to(tl.int64) * o_stride_t + head.to(tl.int64) * o_stride_h
    tl.store(
        out_ptr + o_rows[:, None] + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_mask[None, :],
    )


# See _prefill_kernel: in mixed steps the per-request metadata comes from a packed buffer whose
# offsets change from step to step; specializing on their alignment recompiled mid-run.
@triton.jit(
    do_not_specialize=["bt_stride", "num_splits", "num_shared"],
    do_not_specialize_on_alignment=[
        "seq_lens_ptr", "block_table_ptr", "slot_ptr", "counter_ptr", "kv_start_ptr", "sinks_ptr"
    ],
)  # fmt: skip
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counter_ptr,
    k_new_ptr,
    v_new_ptr,
    slot_ptr,
    seq_lens_ptr,
    block_table_ptr,
    q_stride_t,
    q_stride_h,
    o_stride_t,
    o_stride_h,
    kn_stride_t,
    kn_stride_h,
    vn_stride_t,
    vn_stride_h,
    stride_blk,
    stride_tok,
    stride_head,
    bt_stride,
    scale,
    softcap,
    window,
    head_size,
    num_heads,
    num_kv_heads,
    num_splits,
    kv_start_ptr,
    num_shared,
    k_scale,
    v_scale,
    sinks_ptr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    COMBINE_CHUNK: tl.constexpr,
    CASCADE: tl.constexpr,
    APPEND: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Cascade attention: a request's first kv_start tokens (the shared prefix, for the requests
    # that hold it; 0 for the others) were attended by _shared_prefix_kernel, whose
    # num_shared partials wait in the slots after this request's splits. Never with a window.
    lo = 0
    if CASCADE:
        kv_start = tl.load(kv_start_ptr + seq)
        lo = kv_start
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    # Each split takes a whole number of tiles (at least one); the first ``used`` splits hold
    # the context and the rest exit at once, so a short context is combined over only the
    # splits it fills (and one that fits in a single split is written without a combine).
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N), 1) * BLOCK_N
    used = tl.maximum(tl.cdiv(seq_len - lo, per_split), 1)
    if SPLIT_KV:
        if split >= used:
            return
    s_lo = lo + split * per_split
    s_hi = tl.minimum(s_lo + per_split, seq_len)
    cache_hi = s_hi
    if APPEND:
        # The newest token (position seq_len - 1) is not in the cache yet: the split that
        # owns it takes its key/value from the inputs and writes them to the cache.
        owns_new = (s_lo < s_hi) & (s_hi == seq_len)
        cache_hi = tl.minimum(s_hi, seq_len - 1)

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
    for start in range(s_lo, cache_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < cache_hi
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row, n, n_mask, n_mask[None, :],
            kv_head, stride_blk, stride_tok, stride_head, d, d_mask, scale, softcap, USE_SOFTCAP,
            PAGE, PRECISION, KV_FP8,
        )  # fmt: skip

    if APPEND:
        new_mask = d_mask & owns_new
        k_new = tl.load(k_new_ptr + seq * kn_stride_t + kv_head * kn_stride_h + d, mask=new_mask)
        v_new = tl.load(v_new_ptr + seq * vn_stride_t + kv_head * vn_stride_h + d, mask=new_mask)
        if KV_FP8:
            # As the cache will hold it (and the reference attends over it): e4m3 of
            # value / scale, in the cache's units like the tiles above.
            k_new = _to_fp8(k_new, k_scale)
            v_new = _to_fp8(v_new, v_scale)
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
        if USE_SOFTCAP:
            s_new = softcap * _tanh(s_new / softcap)
        s_new = tl.where(owns_new, s_new * 1.4426950408889634, float("-inf"))
        m_new = tl.maximum(m_i, s_new)
        alpha = tl.exp2(m_i - m_new)
        p_new = tl.exp2(s_new - m_new)
        l_i = l_i * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
        m_i = m_new
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        write = new_mask & (slot >= 0)
        slot = tl.maximum(slot, 0)
        dst = (slot // PAGE) * stride_blk + (slot % PAGE) * stride_tok + kv_head * stride_head + d
        tl.store(k_cache_ptr + dst, k_new.to(k_cache_ptr.dtype.element_ty), mask=write)
        tl.store(v_cache_ptr + dst, v_new.to(v_cache_ptr.dtype.element_ty), mask=write)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if KV_FP8:
        out = out * v_scale
    o_rows = seq * o_stride_t + head.to(tl.int64) * o_stride_h
    o_mask = g_ok[:, None] & d_mask[None, :]
    o_ptrs = out_ptr + o_rows[:, None] + d[None, :]
    if SPLIT_KV:
        merge = used > 1
        if CASCADE:  # a holder of the shared prefix merges even one split with it
            merge = merge | (kv_start > 0)
        if merge:
            # Partials [B, num_heads, parts, HEAD_PAD] and log2-sum-exp [B, num_heads, parts]
            # (parts: the splits, then the shared prefix's); the last of the (request, KV
            # head)'s used splits to arrive combines them all (one launch).
            num_parts = num_splits + num_shared
            base = (seq * num_heads + head) * num_parts  # [G_PAD]
            idx = base + split
            tl.store(part_out_ptr + idx[:, None] * HEAD_PAD + d[None, :], out, mask=g_ok[:, None])
            lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
            tl.store(part_lse_ptr + idx, lse, mask=g_ok)
            counter = counter_ptr + seq * num_kv_heads + kv_head
            # Every warp's partial stores must be issued before the (single-thread) arrival.
            tl.debug_barrier()
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == used - 1:
                tl.atomic_xchg(counter, 0)  # ready for the next launch
                m_run = tl.full([G_PAD], -1.0e30, tl.float32)
                total = tl.zeros([G_PAD], tl.float32)
                merged = tl.zeros([G_PAD, HEAD_PAD], tl.float32)
                m_run, total, merged = _merge_partials(
                    m_run, total, merged, part_out_ptr, part_lse_ptr, base, g_ok, d, used,
                    HEAD_PAD, COMBINE_CHUNK,
                )  # fmt: skip
                if CASCADE:
                    m_run, total, merged = _merge_partials(
                        m_run, total, merged, part_out_ptr, part_lse_ptr, base + num_splits,
                        g_ok, d, num_shared, HEAD_PAD, COMBINE_CHUNK,
                    )  # fmt: skip
                merged = merged / tl.where(total == 0.0, 1.0, total)[:, None]
                if HAS_SINKS:  # once, over every slice and the shared prefix together
                    merged = merged * _sink_scale(sinks_ptr, head, g_ok, m_run, total)[:, None]
                tl.store(o_ptrs, merged.to(out_ptr.dtype.element_ty), o_mask)
            return
    # No split, or a context that fits in one split: this program holds the whole answer.
    # (The partials stored above are the keys' softmax only: the sink joins at the combine.)
    if HAS_SINKS:
        out = out * _sink_scale(sinks_ptr, head, g_ok, m_i, l_i)[:, None]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), o_mask)


@triton.jit
def _merge_partials(
    m_run,
    total,
    merged,
    part_out_ptr,
    part_lse_ptr,
    base,
    g_ok,
    d,
    count,
    HEAD_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Fold the G heads' partial outputs at rows ``base + 0 .. base + count - 1`` into a
    running log2-sum-exp merge (``m_run``: the largest log2-sum-exp so far, ``total``: the
    sum of weights relative to it, ``merged``: the weighted sum of outputs), in chunks of
    ``CHUNK`` partials. Within a chunk the loop is unrolled and holds no store, so its loads
    are in flight together (a loop over the heads with a store per head waited for memory
    once per head); the chunks are a run-time loop, so one compiled variant serves every
    split count."""
    for c in range(0, count, CHUNK):
        sp = c + tl.arange(0, CHUNK)
        lse_c = tl.load(
            part_lse_ptr + base[:, None] + sp[None, :],
            mask=g_ok[:, None] & (sp < count)[None, :],
            other=float("-inf"),
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m_run, tl.max(lse_c, axis=1))
        alpha = tl.exp2(m_run - m_new)
        total = total * alpha + tl.sum(tl.exp2(lse_c - m_new[:, None]), axis=1)
        merged = merged * alpha[:, None]
        for s in tl.static_range(CHUNK):
            s_ok = g_ok & (c + s < count)
            row = base + c + s
            lse_s = tl.load(
                part_lse_ptr + row, mask=s_ok, other=float("-inf"), cache_modifier=".cg"
            )
            part = tl.load(
                part_out_ptr + row[:, None] * HEAD_PAD + d[None, :],
                mask=s_ok[:, None],
                other=0.0,
                cache_modifier=".cg",
            )
            merged += part * tl.exp2(lse_s - m_new)[:, None]
        m_run = m_new
    return m_run, total, merged


@triton.jit(
    do_not_specialize=["num_rows", "bt_stride", "num_parts", "part0"],
    do_not_specialize_on_alignment=["block_table_ptr", "kv_start_ptr", "prefix_ptr"],
)
def _shared_prefix_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    part_out_ptr,
    part_lse_ptr,
    block_table_ptr,
    bt_stride,
    kv_start_ptr,
    prefix_ptr,
    num_rows,
    q_stride_t,
    q_stride_h,
    stride_blk,
    stride_tok,
    stride_head,
    scale,
    softcap,
    head_size,
    num_heads,
    num_parts,
    part0,
    v_scale,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Cascade attention's shared pass: the decode queries (a tile row is one (request,
    head-in-group) pair: rows of many requests share each key/value tile, so the prefix is
    read once per tile of rows instead of once per request) against the shared prefix,
    ``prefix_ptr[0]`` tokens of block-table row ``prefix_ptr[1]``, which the requests with a
    nonzero ``kv_start`` hold; the others' rows see nothing (an empty partial). Both are read
    on the device, so a captured graph serves every prefix. The grid's third axis splits the
    prefix; each split leaves a partial output and log2-sum-exp in slot ``part0 + split`` of
    each row's partials (an empty one when the prefix is too short to reach it), which the
    decode kernel combines. The partials never hold an attention sink: the decode kernel's
    combine adds it once for prefix and rest together, so this kernel has no sink input."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    num_split = tl.num_programs(2)
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < num_rows
    seq = (r // G).to(tl.int64)
    head = kv_head * G + r % G
    d = tl.arange(0, HEAD_PAD)
    d_mask = d < head_size
    q_rows = seq * q_stride_t + head.to(tl.int64) * q_stride_h
    pdl_wait(USE_PDL)
    prefix_len = tl.load(prefix_ptr)
    bt_row = block_table_ptr + tl.load(prefix_ptr + 1).to(tl.int64) * bt_stride
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None] & d_mask[None, :])
    holds = tl.load(kv_start_ptr + seq, mask=row_ok, other=0) > 0

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(prefix_len, num_split), BLOCK_N), 1) * BLOCK_N
    lo = part * per_split
    hi = tl.minimum(lo + per_split, prefix_len)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row, n, n_mask,
            holds[:, None] & n_mask[None, :], kv_head, stride_blk, stride_tok, stride_head, d,
            d_mask, scale, softcap, USE_SOFTCAP, PAGE, PRECISION, KV_FP8,
        )  # fmt: skip

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if KV_FP8:
        out = out * v_scale
    idx = (seq * num_heads + head) * num_parts + part0 + part
    tl.store(part_out_ptr + idx[:, None] * HEAD_PAD + d[None, :], out, mask=row_ok[:, None])
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(part_lse_ptr + idx, lse, mask=row_ok)


def _interpreted(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _precision(dtype: torch.dtype) -> str:
    # float32 models are for exactness tests: keep the dot products in full float32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_sinks(sinks: torch.Tensor | None, query: torch.Tensor) -> None:
    """Attention sinks are read in place (a captured graph keeps the pointer): they must
    already be the float32 ``[num_heads]`` tensor the kernels index, on the query's device."""
    if sinks is None:
        return
    num_heads = query.shape[1]
    if (
        sinks.dtype != torch.float32
        or sinks.shape != (num_heads,)
        or not sinks.is_contiguous()
        or sinks.device != query.device
    ):
        raise ValueError(
            f"sinks must be a contiguous float32 [{num_heads}] tensor on {query.device}, got "
            f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}"
        )


def _cache_halves(kv_cache: torch.Tensor):
    k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, page, kv_heads, head_size]
    assert k_cache.stride(-1) == 1
    return k_cache, v_cache


# Launch configuration of the prefill kernel: rows (token x head pairs) and keys per tile; the
# fastest of the sweep on an H200 (208 TFLOP/s on 8 causal 1024-token prompts).
PREFILL_CONFIG = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}


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
    config: dict | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """Attention for ``num_seqs`` requests with query lengths from ``query_start_loc`` (absolute
    token indices into ``query``/``out`` [T, H, D]) over their paged context; writes ``out``.
    ``num_tokens`` (the tokens these requests own) only sizes the grid. ``sinks`` (float32
    ``[H]``, on the query's device) adds attention sinks; None: plain softmax."""
    if num_seqs == 0 or num_tokens == 0:
        return
    _check_sinks(sinks, query)
    num_heads, head_size = query.shape[1], query.shape[2]
    k_cache, v_cache = _cache_halves(kv_cache)
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    interp = _interpreted(query)
    cfg = dict(PREFILL_CONFIG, **(config or {}))
    if interp:
        cfg = {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}
    block_m = max(cfg["block_m"], triton.next_power_of_2(group))
    block_n = cfg["block_n"]
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
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
        scale * k_scale if fp8 else scale,
        logit_softcap or 0.0,
        sliding_window or 0,
        head_size,
        float(v_scale),
        seq_lens if sinks is None else sinks,  # unused without sinks
        G=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PAGE=page,
        HEAD_PAD=max(16, triton.next_power_of_2(head_size)),
        USE_WINDOW=bool(sliding_window),
        USE_SOFTCAP=bool(logit_softcap),
        PRECISION=_precision(query.dtype),
        KV_FP8=fp8,
        HAS_SINKS=sinks is not None,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
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
# Splits the combine merges per unrolled group (its loads in flight together); a run-time
# loop takes the groups, so the kernel compiles once for every split count.
COMBINE_CHUNK = 8
# Launch configurations of the decode kernel (key/value tile length, warps, pipeline depth),
# for batches that split the context and for those that do not; the fastest of a sweep on an
# H200 (python -m engine_triton.benchmark, 2026-11-29): 3.87 TB/s at 256 x ~850 tokens.
# Tiny batches with many splits do best with longer tiles. In CUDA graphs of 50 launches at
# batch 1 over 160/400/640 tokens, the old choice (32 splits of 32-token tiles) took 7.7/7.6/9.4
# us with Qwen3's heads and 10.3/10.0/13.0 us with Llama-3.1's; the fastest configurations of the
# sweep used 64-token tiles (6.4/7.1/7.7 and 6.3/9.3/9.7 us), 16 splits at the longest context.
DECODE_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 2}
DECODE_SPLIT_CONFIG = {"block_n": 32, "num_warps": 4, "num_stages": 2}
DECODE_MANY_SPLITS_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 2}


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """How many context slices each (request, KV head) gets: enough programs to fill the GPU
    about twice over, once over for the smallest batches (at batch 1-4 the halved count
    measured 10-40% faster: less partial traffic and a shorter combine). A function of the
    batch shape only, so graph replays stay valid."""
    programs = max(num_seqs * num_kv_heads, 1)
    sms = _num_sms(device)
    splits = triton.next_power_of_2(triton.cdiv(2 * sms, programs))
    if 4 * programs <= sms:
        splits //= 2
    return max(1, min(MAX_SPLITS, splits))


# Cascade attention's shared pass (_shared_prefix_kernel): rows of (request, head) pairs per
# tile and prefix tokens per key/value tile. Chosen by `python -m engine_triton.benchmark
# --cascade-only` (H100, Llama-3.1-8B shape, 64/128/256 requests behind 2,000 tokens,
# 2026-12-06): 64.4 / 107.8 / 175.2 us a layer against 67.2 / 111.7 / 179.8 for the prefill
# kernel's 64 x 64 tile it used before; best or within 1% of the best at every size.
SHARED_PREFIX_CONFIG = {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 3}
MAX_SHARED_PARTS = 16


def shared_prefix_splits(programs: int, device: torch.device) -> int:
    """How many slices the shared prefix is cut into when ``programs`` (row tiles x KV heads)
    attend it: enough to fill the GPU about twice over. A function of the batch shape only
    (the prefix length is read on the device), so a captured graph serves every prefix; a
    prefix too short to reach a slice leaves it an empty partial."""
    sms = _num_sms(device)
    splits = triton.next_power_of_2(triton.cdiv(2 * sms, max(programs, 1)))
    return max(1, min(MAX_SHARED_PARTS, splits))


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
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    split_counters: torch.Tensor | None = None,
    config: dict | None = None,
    configs: dict[str, dict] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    cascade_starts: torch.Tensor | None = None,
    cascade_prefix: torch.Tensor | None = None,
    shared_splits: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """One query token per request (request ``i`` is token ``i`` of ``query``/``out``
    [T, H, D]) over its paged context of ``seq_lens[i]`` tokens. Writes ``out[:num_seqs]``.

    With ``key``/``value``/``slot_mapping`` the newest token of each request is not read from
    the cache but taken from ``key``/``value`` [T, Hkv, D] and written to the cache at its slot
    in the same launch (no separate cache-write kernel). ``split_counters`` (int32, zeros, at
    least ``num_seqs * num_kv_heads``; left zeroed by every launch) lets split-KV reduce in the
    same launch; one is allocated when not given. ``configs`` replaces the launch
    configuration of a regime (``"decode"``, ``"decode_split"``, ``"decode_many_splits"``: no
    split, some, 16 or more), e.g. with a platform's tuning table; ``config`` overrides on top.

    Cascade attention (no sliding window): with ``cascade_prefix`` (int32 ``[2]`` on the
    device: a prefix length L in whole cached blocks and a ``block_table`` row that holds it)
    and ``cascade_starts`` (int32 ``[num_seqs]``: L for the requests whose first L tokens are
    those blocks, 0 for the others), the shared prefix is attended once for all its holders
    by ``_shared_prefix_kernel`` (launched first; configuration regime ``"shared_prefix"``),
    each request's own rest by the decode kernel, which merges both. Both tensors are read on
    the device, so a captured graph serves every prefix; ``shared_splits`` fixes how many
    slices the shared pass cuts the prefix into (default: ``shared_prefix_splits``).

    ``sinks`` (float32 ``[H]``, on the query's device; None: plain softmax) adds attention
    sinks, once per (request, head): the splits' and the shared pass's partials leave them out
    and the combine (or the one program that holds a whole context) folds them in. They are
    read on the device, so a captured graph sees new values written in place.
    """
    if num_seqs == 0:
        return
    _check_sinks(sinks, query)
    num_heads, head_size = query.shape[1], query.shape[2]
    k_cache, v_cache = _cache_halves(kv_cache)
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    interp = _interpreted(query)
    if num_splits is None:
        num_splits = decode_splits(num_seqs, num_kv_heads, query.device)
    num_splits = max(1, min(num_splits, MAX_SPLITS))
    regime, base = "decode", DECODE_CONFIG
    if num_splits >= 16:
        regime, base = "decode_many_splits", DECODE_MANY_SPLITS_CONFIG
    elif num_splits > 1:
        regime, base = "decode_split", DECODE_SPLIT_CONFIG
    cfg = dict(base, **(configs or {}).get(regime, {}), **(config or {}))
    if interp:
        cfg = {"block_n": 16, "num_warps": 4, "num_stages": 1}
    head_pad = max(16, triton.next_power_of_2(head_size))
    if (cascade_prefix is None) != (cascade_starts is None):
        raise ValueError("cascade attention needs both cascade_prefix and cascade_starts")
    if cascade_prefix is not None and sliding_window:
        raise ValueError("cascade attention (cascade_prefix) with a sliding window")
    shared_parts = 0
    if cascade_prefix is not None:
        shared_cfg = dict(SHARED_PREFIX_CONFIG, **(configs or {}).get("shared_prefix", {}))
        if interp:
            shared_cfg = {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}
        shared_block_m = max(shared_cfg["block_m"], triton.next_power_of_2(group))
        row_tiles = triton.cdiv(num_seqs * group, shared_block_m)
        shared_parts = shared_splits or shared_prefix_splits(row_tiles * num_kv_heads, query.device)
        shared_parts = max(1, min(shared_parts, MAX_SHARED_PARTS))
    num_parts = num_splits + shared_parts
    if num_parts > 1:
        part_out = torch.empty(
            (num_seqs, num_heads, num_parts, head_pad), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            (num_seqs, num_heads, num_parts), dtype=torch.float32, device=query.device
        )
        if split_counters is None:
            split_counters = torch.zeros(
                num_seqs * num_kv_heads, dtype=torch.int32, device=query.device
            )
        assert split_counters.numel() >= num_seqs * num_kv_heads
    else:
        part_out = part_lse = out  # unused
        split_counters = seq_lens  # unused
    append = key is not None
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if not append:
        key = value = query  # unused
        slot_mapping = seq_lens  # unused
    if shared_parts:
        _shared_prefix_kernel[(row_tiles, num_kv_heads, shared_parts)](
            query,
            k_cache,
            v_cache,
            part_out,
            part_lse,
            block_table,
            block_table.stride(0),
            cascade_starts,
            cascade_prefix,
            num_seqs * group,
            query.stride(0),
            query.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            scale * k_scale if fp8 else scale,
            logit_softcap or 0.0,
            head_size,
            num_heads,
            num_parts,
            num_splits,
            float(v_scale),
            G=group,
            BLOCK_M=shared_block_m,
            BLOCK_N=shared_cfg["block_n"],
            PAGE=page,
            HEAD_PAD=head_pad,
            USE_SOFTCAP=bool(logit_softcap),
            PRECISION=_precision(query.dtype),
            KV_FP8=fp8,
            num_warps=shared_cfg["num_warps"],
            num_stages=shared_cfg["num_stages"],
            **pdl_launch(query.device),
        )
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        split_counters,
        key,
        value,
        slot_mapping,
        seq_lens,
        block_table,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_table.stride(0),
        scale * k_scale if fp8 else scale,
        logit_softcap or 0.0,
        sliding_window or 0,
        head_size,
        num_heads,
        num_kv_heads,
        num_splits,
        cascade_starts if shared_parts else seq_lens,  # unused without a shared prefix
        shared_parts,
        float(k_scale),
        float(v_scale),
        seq_lens if sinks is None else sinks,  # unused without sinks
        G=group,
        G_PAD=max(16, triton.next_power_of_2(group)),
        SPLIT_KV=num_parts > 1,
        COMBINE_CHUNK=COMBINE_CHUNK,
        CASCADE=shared_parts > 0,
        APPEND=append,
        BLOCK_N=cfg["block_n"],
        PAGE=page,
        HEAD_PAD=head_pad,
        USE_WINDOW=bool(sliding_window),
        USE_SOFTCAP=bool(logit_softcap),
        PRECISION=_precision(query.dtype),
        KV_FP8=fp8,
        HAS_SINKS=sinks is not None,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **pdl_launch(query.device),
    )
