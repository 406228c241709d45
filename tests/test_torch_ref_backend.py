"""The torch reference backend against a naive dense attention on random paged inputs."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.attention_backends.interface import AttentionSpec, BatchLayout
from engine.attention_backends.torch_ref import TorchReferenceBackend


def dense_attention(q, k, v, scale, sliding_window=None, softcap=None):
    """Naive attention of one request. q: [Lq, H, D] at the last Lq positions of k/v [L, Hkv, D]."""
    lq, h, _ = q.shape
    lk, hkv, _ = k.shape
    group = h // hkv
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    qpos = torch.arange(lk - lq, lk)[:, None]
    kpos = torch.arange(lk)[None, :]
    visible = kpos <= qpos
    if sliding_window is not None:
        visible &= (qpos - kpos) < sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_step(backend, requests, kv_cache, block_size, rng, dtype):
    """Feed one step: requests are (context_k, context_v, block_ids, num_computed, num_new),
    decodes first. Returns (output, expected)."""
    qs, ks, vs, query_lens, seq_lens, tables, slots = [], [], [], [], [], [], []
    expected = []
    for ck, cv, blocks, done, new in requests:
        q = torch.randn(new, backend.num_heads, backend.head_size, generator=rng).to(dtype)
        qs.append(q)
        ks.append(ck[done : done + new])
        vs.append(cv[done : done + new])
        query_lens.append(new)
        seq_lens.append(done + new)
        tables.append(blocks)
        for pos in range(done, done + new):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        expected.append(
            dense_attention(
                q,
                ck[: done + new],
                cv[: done + new],
                backend.scale,
                backend.sliding_window,
                backend.logit_softcap,
            )
        )
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    layout = BatchLayout(query_lens, seq_lens, tables, slots, block_size, num_decodes)
    md = TorchReferenceBackend.build_metadata(layout, torch.device("cpu"))
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), kv_cache, md)
    return out, torch.cat(expected)


CASES = [
    # heads, kv_heads, head_size, block_size, sliding_window, softcap, dtype
    (4, 4, 16, 4, None, None, torch.float32),
    (8, 2, 32, 16, None, None, torch.float32),
    (6, 3, 24, 8, 7, None, torch.float32),
    (4, 1, 16, 4, None, 30.0, torch.float32),
    (4, 2, 8, 2, 5, 20.0, torch.float32),
    (8, 2, 32, 16, None, None, torch.bfloat16),
    (4, 2, 16, 4, 6, 10.0, torch.bfloat16),
    (4, 2, 16, 4, None, None, torch.float16),
]


@pytest.mark.parametrize("heads,kv_heads,head_size,block_size,window,softcap,dtype", CASES)
def test_mixed_batches_match_dense(heads, kv_heads, head_size, block_size, window, softcap, dtype):
    """Several steps over a shuffled block pool: prefills (some chunked over a cached prefix),
    then decodes batched with new prefills, compared with dense attention per request."""
    rng = torch.Generator().manual_seed(heads * 100 + head_size)
    prng = random.Random(block_size)
    backend = TorchReferenceBackend(
        heads, head_size, kv_heads, 1 / math.sqrt(head_size), window, softcap
    )
    num_blocks = 64
    kv_cache = torch.zeros(
        TorchReferenceBackend.kv_cache_shape(num_blocks, block_size, kv_heads, head_size),
        dtype=dtype,
    )
    pool = list(range(num_blocks))
    prng.shuffle(pool)
    total_lens = [1, 3, 13, 17, 29, 9]
    reqs = []
    for n in total_lens:
        nb = -(-n // block_size)
        blocks = [pool.pop() for _ in range(nb)]
        ck = torch.randn(n, kv_heads, head_size, generator=rng).to(dtype)
        cv = torch.randn(n, kv_heads, head_size, generator=rng).to(dtype)
        reqs.append([ck, cv, blocks, 0])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    # Step 1: prefill the first chunk of every request with >1 tokens left for the end.
    chunks = [max(1, n - 3) if n > 4 else n for n in total_lens]
    chunks[3] = 1  # a 1-token first chunk
    step = [(r[0], r[1], r[2], 0, c) for r, c in zip(reqs, chunks, strict=True)]
    # Decodes (query_len 1) go first.
    step.sort(key=lambda s: s[4] != 1)
    out, exp = run_step(backend, step, kv_cache, block_size, rng, dtype)
    torch.testing.assert_close(out.float(), exp, atol=tol, rtol=tol)
    for r, c in zip(reqs, chunks, strict=True):
        r[3] = c
    # Step 2+: the rest, one request at a time as a prefill chunk or decode, batched together.
    while any(r[3] < r[0].shape[0] for r in reqs):
        step = []
        for r in reqs:
            left = r[0].shape[0] - r[3]
            if left:
                new = 1 if left <= 2 else left - 1
                step.append((r[0], r[1], r[2], r[3], new))
        step.sort(key=lambda s: s[4] != 1)
        out, exp = run_step(backend, step, kv_cache, block_size, rng, dtype)
        torch.testing.assert_close(out.float(), exp, atol=tol, rtol=tol)
        for r in reqs:
            for s in step:
                if s[0] is r[0]:
                    r[3] += s[4]


def test_decode_only_long_context_with_window():
    """Decodes whose contexts span many blocks; out-of-window table entries are placeholders
    (-1 here, as a sliding-window KV manager may leave them) and must never be read."""
    torch.manual_seed(0)
    heads, kv_heads, d, bs, window = 4, 2, 16, 4, 6
    backend = TorchReferenceBackend(heads, d, kv_heads, 0.25, window, None)
    kv_cache = torch.randn(2, 40, bs, kv_heads, d)
    lens = [23, 5, 40]
    tables, slots, expected, qs, ks, vs = [], [], [], [], [], []
    next_block = 0
    for n in lens:
        nb = -(-n // bs)
        table = list(range(next_block, next_block + nb))
        next_block += nb
        ck = torch.randn(n, kv_heads, d)
        cv = torch.randn(n, kv_heads, d)
        for p in range(n - 1):
            kv_cache[0, table[p // bs], p % bs] = ck[p]
            kv_cache[1, table[p // bs], p % bs] = cv[p]
        first_needed = max(0, n - window) // bs
        table = [-1] * first_needed + table[first_needed:]
        tables.append(table)
        slots.append(table[(n - 1) // bs] * bs + (n - 1) % bs)
        q = torch.randn(1, heads, d)
        qs.append(q)
        ks.append(ck[-1:])
        vs.append(cv[-1:])
        expected.append(dense_attention(q, ck, cv, 0.25, window))
    layout = BatchLayout([1] * 3, lens, tables, slots, bs, 3)
    md = TorchReferenceBackend.build_metadata(layout, torch.device("cpu"))
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), kv_cache, md)
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_padding_slots_are_not_written():
    backend = TorchReferenceBackend(2, 8, 2, 0.3)
    kv_cache = torch.zeros(2, 4, 4, 2, 8)
    layout = BatchLayout([2], [2], [[1]], [4, 5], 4, 0)
    md = TorchReferenceBackend.build_metadata(layout, torch.device("cpu"))
    md.slot_mapping = torch.tensor([4, 5, -1])
    q, k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    out = backend.forward(q, k, v, kv_cache, md)
    assert torch.equal(kv_cache[0, 1, :2], k[:2])
    assert kv_cache[:, [0, 2, 3]].abs().sum() == 0 and kv_cache[:, 1, 2:].abs().sum() == 0
    assert torch.equal(out[2], torch.zeros(2, 8))


def test_supports_declares_features():
    spec = AttentionSpec(
        device_type="cuda", dtype="bfloat16", sliding_window=True, logit_softcap=True
    )
    assert TorchReferenceBackend.supports(spec) == []
    assert TorchReferenceBackend.name == "torch"


def dense_with_spans(q, k, v, scale, spans, sliding_window=None, softcap=None):
    """Naive attention of one request whose queries also see later keys inside ``spans``."""
    lq, h, _ = q.shape
    lk, hkv, _ = k.shape
    group = h // hkv
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    qpos = torch.arange(lk - lq, lk)[:, None]
    kpos = torch.arange(lk)[None, :]
    same_span = torch.zeros(lq, lk, dtype=torch.bool)
    for s, e in spans:
        same_span |= (qpos >= s) & (qpos < e) & (kpos >= s) & (kpos < e)
    visible = (kpos <= qpos) | same_span
    if sliding_window is not None:
        visible &= (qpos - kpos) < sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 20.0), (9, 10.0)])
def test_bidirectional_spans_match_dense(window, softcap):
    """Spans (an image's placeholder tokens in Gemma 3) let their queries see later keys of the
    span: a fresh prefill with two spans, a chunk over a cached prefix whose span starts in the
    cache, and a decode batched with them, against a dense mask per request."""
    heads, kv_heads, head_size, bs = 4, 2, 16, 4
    rng = torch.Generator().manual_seed(7)
    backend = TorchReferenceBackend(heads, head_size, kv_heads, head_size**-0.5, window, softcap)
    assert TorchReferenceBackend.supports(AttentionSpec(bidirectional_spans=True)) == []
    kv_cache = torch.zeros(TorchReferenceBackend.kv_cache_shape(32, bs, kv_heads, head_size))
    ctx = [torch.randn(n, kv_heads, head_size, generator=rng) for n in (5, 21, 18)]
    vals = [torch.randn(n, kv_heads, head_size, generator=rng) for n in (5, 21, 18)]
    tables = [[0, 1], [2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12]]
    # (request, computed before, new tokens, spans); request 2's span 6..10 starts in the cache.
    plans = [
        [(0, 0, 4, []), (1, 0, 21, [(3, 7), (12, 16)]), (2, 0, 8, [])],
        [(0, 4, 1, []), (2, 8, 10, [(6, 10), (14, 17)])],
    ]
    for plan in plans:
        qs, ks, vs, qlens, slens, tabs, slots, spans, want = [], [], [], [], [], [], [], [], []
        for r, done, new, sp in plan:
            q = torch.randn(new, heads, head_size, generator=rng)
            qs.append(q)
            ks.append(ctx[r][done : done + new])
            vs.append(vals[r][done : done + new])
            qlens.append(new)
            slens.append(done + new)
            tabs.append(tables[r])
            spans.append(sp)
            slots += [tables[r][p // bs] * bs + p % bs for p in range(done, done + new)]
            want.append(
                dense_with_spans(
                    q, ctx[r][: done + new], vals[r][: done + new], backend.scale, sp, window,
                    softcap,
                )
            )  # fmt: skip
        nd = sum(1 for n in qlens if n == 1)
        layout = BatchLayout(qlens, slens, tabs, slots, bs, nd, bidirectional_spans=spans)
        md = TorchReferenceBackend.build_metadata(layout, torch.device("cpu"))
        out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), kv_cache, md)
        torch.testing.assert_close(out, torch.cat(want), atol=1e-5, rtol=1e-5)
    # The spans change the result (a causal-only backend would fail this test).
    causal = dense_attention(qs[-1], ctx[2], vals[2], backend.scale, window, softcap)
    assert not torch.allclose(causal, want[-1], atol=1e-3)


def test_backend_without_span_support_says_why():
    from engine.attention_backends.interface import AttentionBackend

    class Causal(AttentionBackend):
        name = "causal-only"

        def forward(self, *a):  # pragma: no cover - never called
            raise NotImplementedError

    reasons = Causal.supports(AttentionSpec(bidirectional_spans=True))
    assert any("bidirectional attention within image tokens" in r for r in reasons), reasons
