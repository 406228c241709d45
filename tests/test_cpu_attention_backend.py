"""engine-cpu's ``cpu`` attention backend (compiled decode and cache write, the torch reference's
prefill): against naive dense attention on the reference backend's own cases, bit for bit the
reference where it hands a case over (an FP8 cache), and chosen by ``auto`` on the cpu platform
where the compiled kernels build."""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_torch_ref_backend import CASES, dense_attention, run_step

from engine.attention_backends.interface import BatchLayout
from engine.attention_backends.torch_ref import TorchReferenceBackend
from engine_cpu import native
from engine_cpu.attention import CpuAttentionBackend

pytestmark = pytest.mark.skipif(
    native.load("avx2") is None, reason=f"no AVX2 kernels here: {native.unavailable_reason('avx2')}"
)


@pytest.mark.parametrize("heads,kv_heads,head_size,block_size,window,softcap,dtype", CASES)
def test_steps_of_decodes_and_prefills_match_dense(
    heads, kv_heads, head_size, block_size, window, softcap, dtype
):
    """Every request prefilled in one or two chunks, then decoded token by token beside the
    others' prefills, over a shuffled block pool (float16 runs the reference's path)."""
    rng = torch.Generator().manual_seed(heads * 100 + head_size)
    prng = random.Random(block_size)
    backend = CpuAttentionBackend(
        heads, head_size, kv_heads, 1 / math.sqrt(head_size), window, softcap
    )
    num_blocks = 64
    kv_cache = torch.zeros(
        CpuAttentionBackend.kv_cache_shape(num_blocks, block_size, kv_heads, head_size),
        dtype=dtype,
    )
    pool = list(range(num_blocks))
    prng.shuffle(pool)
    reqs = []
    for n in (1, 3, 13, 17, 29, 9, 40):
        blocks = [pool.pop() for _ in range(-(-n // block_size))]
        ck = torch.randn(n, kv_heads, head_size, generator=rng).to(dtype)
        cv = torch.randn(n, kv_heads, head_size, generator=rng).to(dtype)
        reqs.append([ck, cv, blocks, 0])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    decoded = 0
    while any(r[3] < r[0].shape[0] for r in reqs):
        step = []
        for r in reqs:
            left = r[0].shape[0] - r[3]
            if left:
                new = left if r[3] == 0 and left < 8 else (left // 2 if r[3] == 0 else 1)
                step.append((r[0], r[1], r[2], r[3], new))
        step.sort(key=lambda s: s[4] != 1)  # decodes first
        decoded += sum(s[4] == 1 for s in step)
        out, exp = run_step(backend, step, kv_cache, block_size, rng, dtype)
        torch.testing.assert_close(out.float(), exp, atol=tol, rtol=tol)
        for r in reqs:
            for s in step:
                if s[0] is r[0]:
                    r[3] += s[4]
    assert decoded > 40


def test_decodes_never_read_blocks_that_left_the_window():
    """Table entries before the window are placeholders (-1): reading one would crash or
    pollute the result."""
    torch.manual_seed(0)
    heads, kv_heads, d, bs, window = 8, 2, 64, 4, 6
    backend = CpuAttentionBackend(heads, d, kv_heads, 0.125, window, None)
    kv_cache = torch.randn(2, 40, bs, kv_heads, d)
    tables, slots, expected, qs, ks, vs = [], [], [], [], [], []
    next_block = 0
    lens = [23, 5, 40]
    for n in lens:
        nb = -(-n // bs)
        table = list(range(next_block, next_block + nb))
        next_block += nb
        ck, cv = torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
        for p in range(n - 1):
            kv_cache[0, table[p // bs], p % bs] = ck[p]
            kv_cache[1, table[p // bs], p % bs] = cv[p]
        first_needed = max(0, n - window) // bs
        tables.append([-1] * first_needed + table[first_needed:])
        slots.append(table[(n - 1) // bs] * bs + (n - 1) % bs)
        q = torch.randn(1, heads, d)
        qs.append(q)
        ks.append(ck[-1:])
        vs.append(cv[-1:])
        expected.append(dense_attention(q, ck, cv, 0.125, window))
    layout = BatchLayout([1] * 3, lens, tables, slots, bs, 3)
    md = CpuAttentionBackend.build_metadata(layout, torch.device("cpu"))
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), kv_cache, md)
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float16])
def test_caches_the_kernels_do_not_take_run_the_reference(cache_dtype):
    torch.manual_seed(1)
    args = (4, 16, 2, 0.25)
    ours, ref = CpuAttentionBackend(*args), TorchReferenceBackend(*args)
    layout = BatchLayout([1, 5], [9, 5], [[3, 1, 0], [2, 4]], [0, 8, 9, 10, 11, 12], 4, 1)
    md = CpuAttentionBackend.build_metadata(layout, torch.device("cpu"))
    dtype = torch.float16 if cache_dtype == torch.float16 else torch.float32
    q, k, v = (torch.randn(6, n, 16).to(dtype) for n in (4, 2, 2))
    base = torch.randn(2, 5, 4, 2, 16).to(cache_dtype)
    got_cache, want_cache = base.clone(), base.clone()
    got = ours.forward(q, k, v, got_cache, md)
    want = ref.forward(q, k, v, want_cache, md)
    assert torch.equal(got, want)
    assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))


def test_padding_rows_stay_zero_and_padding_slots_are_not_written():
    backend = CpuAttentionBackend(2, 8, 2, 0.3)
    kv_cache = torch.zeros(2, 4, 4, 2, 8)
    layout = BatchLayout([1, 1], [3, 2], [[1], [2]], [6, 9], 4, 2)
    md = CpuAttentionBackend.build_metadata(layout, torch.device("cpu"))
    md.slot_mapping = torch.tensor([6, 9, -1])
    q, k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    out = backend.forward(q, k, v, kv_cache, md)
    assert torch.equal(kv_cache[0, 1, 2], k[0]) and torch.equal(kv_cache[1, 2, 1], v[1])
    assert int((kv_cache != 0).sum()) == 2 * 2 * 2 * 8  # 2 slots x 2 heads x (k, v) x 8
    assert torch.equal(out[2], torch.zeros(2, 8))


def test_auto_picks_the_cpu_backend_where_the_kernels_build(monkeypatch):
    from engine.plugins import PluginManager
    from engine_cpu.platform import CpuPlatform

    assert CpuPlatform.default_attention_backends() == ["cpu", "torch"]
    manager = PluginManager.from_env()
    backends = manager.attention_backends()
    assert backends.get("cpu") is CpuAttentionBackend
    assert CpuAttentionBackend.unavailable_reasons() == []
    monkeypatch.setenv("ENGINE_CPU_NATIVE", "0")
    (reason,) = CpuAttentionBackend.unavailable_reasons()
    assert "compiled AVX2 kernels" in reason and "ENGINE_CPU_NATIVE=0" in reason


@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("window,softcap", [(None, None), (300, None), (None, 20.0)])
def test_long_contexts_split_over_threads_match_dense(threads, window, softcap):
    """Fewer (request, KV head) pairs than threads: each context is cut into slices whose
    softmax sums are combined (one KV head, batch 1 and 2, contexts of 1 to 900 tokens; an
    empty context gives zeros)."""
    torch.manual_seed(threads)
    heads, kv_heads, d, bs = 4, 1, 64, 16
    backend = CpuAttentionBackend(heads, d, kv_heads, 0.125, window, softcap)
    kv_cache = torch.randn(2, 64, bs, kv_heads, d)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for lens in ([900], [1], [130, 700], [200, 0]):
            tables, slots, qs, ks, vs, expected = [], [], [], [], [], []
            next_block = 0
            for n in lens:
                nb = max(1, -(-n // bs))
                table = list(range(next_block, next_block + nb))
                next_block += nb
                ck, cv = torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
                for p in range(max(n - 1, 0)):
                    kv_cache[0, table[p // bs], p % bs] = ck[p]
                    kv_cache[1, table[p // bs], p % bs] = cv[p]
                tables.append(table)
                slots.append(table[(n - 1) // bs] * bs + (n - 1) % bs if n else -1)
                q = torch.randn(1, heads, d)
                qs.append(q)
                ks.append(ck[-1:] if n else torch.zeros(1, kv_heads, d))
                vs.append(cv[-1:] if n else torch.zeros(1, kv_heads, d))
                want = torch.zeros(1, heads, d)
                if n:
                    want = dense_attention(q, ck, cv, 0.125, window, softcap=softcap)
                expected.append(want)
            layout = BatchLayout([1] * len(lens), lens, tables, slots, bs, len(lens))
            md = CpuAttentionBackend.build_metadata(layout, torch.device("cpu"))
            backend._write_kv(torch.cat(ks), torch.cat(vs), kv_cache, md)
            out = backend._decode(torch.cat(qs), kv_cache, md, lens)
            torch.testing.assert_close(out, torch.cat(expected), atol=2e-5, rtol=2e-5)
    finally:
        torch.set_num_threads(before)
