"""engine-llm-triton's paged attention (prefill, chunked prefill, split-KV decode) and the
``triton`` backend against a float64 oracle, on random paged batches with shuffled blocks."""

from __future__ import annotations

import pytest
import torch
from paged_reference import TOLERANCE, make_batch, reference_attention, rel_error

DTYPES = [torch.float32, torch.bfloat16]


def _tensors(batch, device):
    from engine.attention_backends.interface import AttentionBackend, BatchLayout

    layout = BatchLayout(
        query_lens=batch.query_lens,
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        slot_mapping=batch.slot_mapping,
        block_size=batch.block_size,
        num_decodes=batch.num_decodes,
    )
    return AttentionBackend.build_metadata(layout, torch.device(device))


def _check(out, batch, scale, window, cap, dtype, seed):
    expected = reference_attention(
        batch.query, batch.kv_cache, batch.query_lens, batch.seq_lens, batch.block_tables,
        scale, window, cap,
    )  # fmt: skip
    err = rel_error(out, expected)
    assert err < TOLERANCE[dtype], f"seed={seed} rel_error={err}"


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,window,cap",
    [
        (torch.float32, 4, 2, None, None),  # GQA
        (torch.bfloat16, 3, 1, 5, None),  # odd group, sliding window
        (torch.float32, 2, 2, 6, 4.0),  # MHA, window and soft-cap
    ],
)
def test_prefill_over_cached_prefix(dtype, heads, kv_heads, window, cap, device, seed):
    """Chunked prefill: queries are the tail of each context, the prefix is already cached."""
    from engine_triton.kernels.attention import paged_prefill

    # A fresh prompt, a chunk after a prefix, a one-token prefill.
    batch = make_batch([7, 5, 1], [7, 13, 4], heads, kv_heads, 20, 4, dtype, device)
    meta = _tensors(batch, device)
    out = torch.full_like(batch.query, float("nan"))
    scale = 20**-0.5
    paged_prefill(
        batch.query, batch.kv_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_table,
        3, meta.num_actual_tokens, scale, window, cap,
    )  # fmt: skip
    _check(out, batch, scale, window, cap, dtype, seed)


@pytest.mark.parametrize(
    "dtype,splits,window,cap,append",
    [
        (torch.float32, 1, None, None, False),
        (torch.bfloat16, 4, None, None, False),  # split-KV, combined in the same launch
        (torch.float32, 2, 9, None, True),  # splits over a sliding window, fused append
        (torch.bfloat16, 2, None, 3.0, True),
        (torch.float32, 1, 4, 2.0, True),
    ],
)
def test_decode_split_kv(dtype, splits, window, cap, append, device, seed):
    from engine.kernels.reference import write_kv_cache
    from engine_triton.kernels.attention import paged_decode

    # seq_len 1 and one shorter than the number of splits leave some splits empty.
    batch = make_batch([1, 1, 1], [37, 1, 3], 4, 2, 16, 8, dtype, device)
    meta = _tensors(batch, device)
    expected_cache = batch.kv_cache.clone()
    write_kv_cache(batch.key, batch.value, expected_cache, meta.slot_mapping)
    if not append:  # the kernel reads the newest token from the cache
        batch.kv_cache.copy_(expected_cache)
    out = torch.full_like(batch.query, float("nan"))
    counters = torch.zeros(3 * 2, dtype=torch.int32, device=device)
    scale = 0.3
    extra = dict(key=batch.key, value=batch.value, slot_mapping=meta.slot_mapping) if append else {}
    paged_decode(
        batch.query, batch.kv_cache, out, meta.seq_lens, meta.block_table, 3, scale, window, cap,
        num_splits=splits, split_counters=counters, **extra,
    )  # fmt: skip
    assert torch.equal(batch.kv_cache.cpu(), expected_cache.cpu()), f"seed={seed}"
    assert not counters.any(), "the arrival counters must be left at zero"
    _check(out, batch, scale, window, cap, dtype, seed)


@pytest.mark.parametrize("splits", [8, 32])
def test_decode_combines_only_the_splits_a_context_fills(splits, device, seed):
    """Many splits over contexts of different lengths and a group of 8 query heads per KV
    head (Qwen3-30B-A3B's 32/4): a long context fills several splits and is combined across
    them; a short one fills one and is written without a combine; the unused splits exit."""
    from engine.kernels.reference import write_kv_cache
    from engine_triton.kernels.attention import paged_decode

    batch = make_batch([1, 1, 1, 1], [300, 70, 16, 2], 16, 2, 32, 16, torch.float32, device)
    meta = _tensors(batch, device)
    expected_cache = batch.kv_cache.clone()
    write_kv_cache(batch.key, batch.value, expected_cache, meta.slot_mapping)
    out = torch.full_like(batch.query, float("nan"))
    counters = torch.zeros(4 * 2, dtype=torch.int32, device=device)
    for _ in range(2):  # the counters left at zero serve the next launch
        paged_decode(
            batch.query, batch.kv_cache, out, meta.seq_lens, meta.block_table, 4, 0.2,
            num_splits=splits, split_counters=counters, key=batch.key, value=batch.value,
            slot_mapping=meta.slot_mapping,
        )  # fmt: skip
        assert not counters.any(), "the arrival counters must be left at zero"
    assert torch.equal(batch.kv_cache.cpu(), expected_cache.cpu()), f"seed={seed}"
    _check(out, batch, 0.2, None, None, torch.float32, seed)


def _share_prefix(batch, shared_blocks, rows=None):
    """Make the first ``shared_blocks`` blocks of requests ``rows`` (default: all) those of
    request 0 (the blocks they replace stay in the cache, unreferenced), as the prefix cache
    does."""
    for i, table in enumerate(batch.block_tables):
        if i and (rows is None or i in rows):
            table[:shared_blocks] = batch.block_tables[0][:shared_blocks]
    return shared_blocks * batch.block_size


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,splits,shared_splits,append,cap,holders",
    [
        (torch.float32, 4, 2, 1, 1, True, None, None),  # one slice each side
        (torch.bfloat16, 4, 1, 2, 3, True, None, None),  # split rest, prefix in 3 slices
        (torch.float32, 3, 3, 4, 2, False, 2.5, None),  # MHA, soft-cap, newest from the cache
        (torch.bfloat16, 8, 2, 1, 2, True, None, None),  # 5 requests x 4 heads: 2 row tiles
        (torch.float32, 4, 2, 2, 2, True, None, {1, 3, 4}),  # request 2 holds other blocks
    ],
)
def test_decode_cascade_over_shared_prefix(
    dtype, heads, kv_heads, splits, shared_splits, append, cap, holders, device, seed
):
    """Cascade attention: the shared prefix attended once for the requests that hold it,
    each request's rest (a non-holder's whole context) by the decode kernel, merged; the same
    attention as without it. Some requests have nothing after the prefix but their newest
    token, one has more splits than tokens."""
    from engine.attention_backends.interface import (
        CascadeInputs,
        SharedPrefix,
        find_shared_prefix,
    )
    from engine.kernels.reference import write_kv_cache
    from engine_triton.kernels.attention import paged_decode

    seq_lens = [29, 21, 40, 21, 25]
    batch = make_batch([1] * 5, seq_lens, heads, kv_heads, 16, 4, dtype, device)
    prefix = _share_prefix(batch, 5, holders)  # 20 tokens; the shortest request has 21
    rows = tuple(sorted({0} | (holders or {1, 2, 3, 4})))
    found = find_shared_prefix(batch.block_tables, seq_lens, 5, 4)
    assert found == SharedPrefix(prefix, rows)
    cascade = CascadeInputs.from_prefix(found, 5, device)
    meta = _tensors(batch, device)
    expected_cache = batch.kv_cache.clone()
    write_kv_cache(batch.key, batch.value, expected_cache, meta.slot_mapping)
    if not append:
        batch.kv_cache.copy_(expected_cache)
    out = torch.full_like(batch.query, float("nan"))
    counters = torch.zeros(5 * kv_heads, dtype=torch.int32, device=device)
    extra = dict(key=batch.key, value=batch.value, slot_mapping=meta.slot_mapping) if append else {}
    paged_decode(
        batch.query, batch.kv_cache, out, meta.seq_lens, meta.block_table, 5, 0.3, None, cap,
        num_splits=splits, split_counters=counters, cascade_starts=cascade.starts,
        cascade_prefix=cascade.prefix, shared_splits=shared_splits, **extra,
    )  # fmt: skip
    assert torch.equal(batch.kv_cache.cpu(), expected_cache.cpu()), f"seed={seed}"
    assert not counters.any(), "the arrival counters must be left at zero"
    _check(out, batch, 0.3, None, cap, dtype, seed)


def test_backend_cascade_from_metadata(device, seed):
    """``forward`` runs cascade attention when the metadata names a shared prefix, and the
    answer matches the oracle; under a sliding window it ignores the prefix."""
    from engine.attention_backends.interface import CascadeInputs, SharedPrefix
    from engine_triton.attention import TritonAttentionBackend

    batch = make_batch([1, 1, 1, 4], [18, 23, 17, 9], 4, 2, 16, 4, torch.float32, device)
    prefix = _share_prefix(batch, 4, {2})  # request 1 holds its own blocks
    meta = _tensors(batch, device)
    meta.cascade = CascadeInputs.from_prefix(SharedPrefix(prefix, (0, 2)), 3, device)
    for window in (None, 7):
        backend = TritonAttentionBackend(4, 16, 2, 0.25, sliding_window=window)
        out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, meta)
        _check(out, batch, 0.25, window, None, torch.float32, seed)


def test_find_shared_prefix():
    from engine.attention_backends.interface import SharedPrefix, find_shared_prefix

    tables = [[7, 3, 9, 1], [7, 3, 9, 2], [7, 3, 5]]
    # Blocks 7, 3 held by all three beat 7, 3, 9 held by two: (3 - 1) * 2 > (2 - 1) * 3.
    assert find_shared_prefix(tables, [16, 15, 12], 3, 4) == SharedPrefix(8, (0, 1, 2))
    # Only blocks below every request's newest token count (the third block holds it here).
    assert find_shared_prefix([[7, 3, 9], [7, 3, 9]], [9, 12], 2, 4) == SharedPrefix(8, (0, 1))
    assert find_shared_prefix([[7, 3], [7, 3]], [8, 8], 2, 4) == SharedPrefix(4, (0, 1))
    assert find_shared_prefix(tables, [16, 15, 12], 1, 4) is None  # one decode: no sharing
    assert find_shared_prefix([[7, 3], [8, 3]], [8, 8], 2, 4) is None
    # Only the decodes (the first num_decodes rows) are compared.
    assert find_shared_prefix([[7, 3, 1], [7, 3, 2], [7, 3]], [12, 12, 8], 2, 4) == SharedPrefix(
        8, (0, 1)
    )
    # A request that computed the same prompt again (other blocks) is left out, not a veto;
    # the most common first block wins.
    many = [[5, 6, 7, 8]] + [[1, 2, 3, 40 + i] for i in range(4)] + [[1, 9, 9, 9]]
    assert find_shared_prefix(many, [16] * 6, 6, 4) == SharedPrefix(12, (1, 2, 3, 4))


def test_find_shared_prefix_against_brute_force():
    """Random tables grown from a few shared stems (as the prefix cache hands them out):
    the prefix found is the one a brute-force search over every length picks."""
    import random

    from engine.attention_backends.interface import find_shared_prefix

    rng = random.Random(7)
    for _ in range(200):
        stems = [[rng.randrange(1000) for _ in range(rng.randint(1, 12))] for _ in range(3)]
        tables, lens = [], []
        for i in range(rng.randint(2, 24)):
            stem = rng.choice(stems)
            table = stem[: rng.randint(0, len(stem))] + [5000 + 100 * i + j for j in range(4)]
            tables.append(table[: rng.randint(1, len(table))])
            lens.append(4 * len(tables[-1]) - rng.randint(0, 3))
        found = find_shared_prefix(tables, lens, len(tables), 4)
        # Brute force: among the decodes with the most common first block, every length L and
        # the decodes whose usable blocks start with the longest one's first L blocks.
        firsts = [t[0] for t in tables]
        first = max(firsts, key=firsts.count)  # the first seen among equals, as Counter
        members = [i for i, t in enumerate(tables) if t[0] == first]
        usable = {i: min(len(tables[i]), (lens[i] - 1) // 4) for i in members}
        ref = tables[max(members, key=lambda i: (usable[i], -i))]
        best = (0, 0, ())
        for length in range(1, max(usable.values()) + 1):
            rows = tuple(
                i for i in members if usable[i] >= length and tables[i][:length] == ref[:length]
            )
            best = max(best, ((len(rows) - 1) * length, length, rows))
        if firsts.count(first) < 2 or best[0] <= 0:
            assert found is None, (tables, lens, found)
        else:
            assert (found.length, found.rows) == (best[1] * 4, best[2]), (tables, lens, found)


def test_decode_skips_empty_padding_rows(device, seed):
    """A padded graph batch has requests of length 0: their output is zero, never NaN."""
    from engine_triton.kernels.attention import paged_decode

    batch = make_batch([1, 1], [5, 9], 2, 1, 16, 4, torch.float32, device)
    meta = _tensors(batch, device)
    seq_lens = meta.seq_lens.clone()
    seq_lens[1] = 0
    slots = meta.slot_mapping.clone()
    slots[1] = -1
    cache_before = batch.kv_cache.clone()
    out = torch.full_like(batch.query, float("nan"))
    paged_decode(batch.query, batch.kv_cache, out, seq_lens, meta.block_table, 2, 0.25,
                 num_splits=2, key=batch.key, value=batch.value, slot_mapping=slots)  # fmt: skip
    assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu())), f"seed={seed}"
    changed = (batch.kv_cache != cache_before).flatten(2).any(-1)  # [2, blocks * page]
    assert changed.sum().item() == 2, "only request 0's key and value are written"
    expected = reference_attention(batch.query[:1], batch.kv_cache, [1], [5],
                                   batch.block_tables[:1], 0.25)  # fmt: skip
    assert rel_error(out[:1], expected) < 1e-5, f"seed={seed}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_mixed_batch_writes_then_attends(dtype, device, seed):
    """Decodes first, then prefill chunks, through ``TritonAttentionBackend.forward``: it
    writes the new keys/values (a padding slot is skipped) and attends over the cache."""
    from engine_triton.attention import TritonAttentionBackend

    heads, kv_heads, head_size, window = 4, 2, 16, 6
    batch = make_batch([1, 1, 6, 3], [10, 3, 6, 11], heads, kv_heads, head_size, 4, dtype, device)
    backend = TritonAttentionBackend(heads, head_size, kv_heads, 0.25, sliding_window=window)
    meta = _tensors(batch, device)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, meta)
    # The oracle reads the cache the reference kernel would have written.
    from engine.kernels.reference import write_kv_cache

    expected_cache = batch.kv_cache.clone()
    write_kv_cache(batch.key, batch.value, expected_cache, meta.slot_mapping)
    assert torch.equal(batch.kv_cache.cpu(), expected_cache.cpu())
    _check(out, batch, 0.25, window, None, dtype, seed)


def test_backend_reads_cache_written_by_reference(device, seed):
    """Same KV layout as the reference: a prefix written by ``reference.write_kv_cache`` is
    what the Triton decode reads."""
    from engine.kernels.reference import write_kv_cache
    from engine_triton.attention import TritonAttentionBackend

    batch = make_batch([1], [9], 2, 1, 16, 4, torch.float32, device)
    batch.kv_cache.normal_()
    table = batch.block_tables[0]
    prefix_slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(8)], device=device)
    write_kv_cache(
        torch.randn(8, 1, 16, device=device), torch.randn(8, 1, 16, device=device),
        batch.kv_cache, prefix_slots,
    )  # fmt: skip
    backend = TritonAttentionBackend(2, 16, 1, 0.25)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache,
                          _tensors(batch, device))  # fmt: skip
    _check(out, batch, 0.25, None, None, torch.float32, seed)


def test_backend_supports_reasons(monkeypatch):
    from engine.attention_backends.interface import AttentionSpec
    from engine_triton.attention import TritonAttentionBackend

    spec = AttentionSpec(device_type="cuda", dtype="bfloat16", head_size=128,
                         sliding_window=True, logit_softcap=True)  # fmt: skip
    assert TritonAttentionBackend.supports(spec) == []
    assert TritonAttentionBackend.supports(AttentionSpec(device_type="cuda", head_size=512))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reasons = TritonAttentionBackend.supports(AttentionSpec(device_type="cpu"))
    assert any("TRITON_INTERPRET" in r for r in reasons)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonAttentionBackend.supports(AttentionSpec(device_type="cpu")) == []


def test_cascade_benchmark_sweep_runs(monkeypatch, capsys):
    """``python -m engine_triton.benchmark --cascade-only`` end to end on a tiny shape with the
    GPU timer stubbed (the numbers mean nothing here; the code path and the comparison of
    every configuration's output with the plain decode kernel's do)."""
    from engine_triton import benchmark

    if torch.cuda.is_available():
        pytest.skip("runs for real on a GPU: python -m engine_triton.benchmark --cascade-only")
    monkeypatch.setattr(benchmark, "CASCADE_SHAPES", {"tiny": dict(hq=4, hkv=2, d=16, layers=2)})
    monkeypatch.setattr(benchmark, "CASCADE_PREFIX", 48)
    monkeypatch.setattr(benchmark, "CASCADE_SUFFIX", (1, 20))
    monkeypatch.setattr(benchmark, "_graph_us", lambda call: (call(0), call(1), 3.0)[-1])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "interpreter")
    configs = [{"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}]
    results: dict = {}
    benchmark.sweep_cascade(results, batches=(3,), configs=configs, device="cpu")
    out = capsys.readouterr().out
    assert "cascade tiny B=3" in out and "plain decode" in out and "ERROR" not in out
    rows = results["cascade tiny B=3"]["rows"]
    assert len(rows) == 2 and all("error" not in r for r in rows), rows
    assert all(r.get("max_err", 0) < 0.05 for r in rows), rows
