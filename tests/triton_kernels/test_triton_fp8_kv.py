"""The triton backend on an FP8 KV cache (per-layer scales) against the torch reference backend
on the same cache: prefill, chunked prefill over a cached prefix, and split-KV decodes that
append their own key/value (quantized in the kernel). Keys and values are exact in e4m3 after
the power-of-two scales, so Triton's interpreter (whose e4m3 rounding is off at binade carries)
is exact too."""

from __future__ import annotations

import pytest
import torch


def _fp8_exact(rows, heads, d, scale, gen):
    from engine.testing.inputs import _fp8_rows

    return (_fp8_rows(rows, heads * d, gen).float() * scale).view(rows, heads, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
def test_triton_backend_on_an_fp8_cache_matches_the_reference(dtype, splits, device, seed):
    from engine.attention_backends.interface import BatchLayout
    from engine.attention_backends.torch_ref import TorchReferenceBackend
    from engine.kernels.reference import write_kv_cache
    from engine_triton.attention import TritonAttentionBackend

    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, d, bs = 4, 2, 32, 4
    k_scale, v_scale = 2.0**-6, 2.0**-5
    query_lens, seq_lens = [1, 1, 6, 3], [9, 3, 6, 11]
    tables = [[3, 0, 7], [1], [2, 4], [5, 6, 8]]
    slots = []
    for table, q, n in zip(tables, query_lens, seq_lens, strict=True):
        slots += [table[p // bs] * bs + p % bs for p in range(n - q, n)]
    layout = BatchLayout(query_lens, seq_lens, tables, slots, bs, 2)
    t = sum(query_lens)
    q = torch.randn(t, heads, d, generator=gen).to(dtype)
    k = _fp8_exact(t, kv_heads, d, k_scale, gen).to(dtype)
    v = _fp8_exact(t, kv_heads, d, v_scale, gen).to(dtype)
    cache = torch.zeros(2, 9, bs, kv_heads, d).to(torch.float8_e4m3fn)
    for table, ql, n in zip(tables, query_lens, seq_lens, strict=True):
        if n - ql:  # the cached prefix
            pk = _fp8_exact(n - ql, kv_heads, d, k_scale, gen)
            pv = _fp8_exact(n - ql, kv_heads, d, v_scale, gen)
            pos = torch.tensor([table[p // bs] * bs + p % bs for p in range(n - ql)])
            write_kv_cache(pk, pv, cache, pos, k_scale, v_scale)
    ref = TorchReferenceBackend(heads, d, kv_heads, d**-0.5)
    tri = TritonAttentionBackend(heads, d, kv_heads, d**-0.5)
    for b in (ref, tri):
        b.k_scale, b.v_scale = k_scale, v_scale
    ref_cache, tri_cache = cache.clone(), cache.to(device)
    md_ref = TorchReferenceBackend.build_metadata(layout, torch.device("cpu"))
    md_tri = TritonAttentionBackend.build_metadata(layout, torch.device(device))
    want = ref.forward(q, k, v, ref_cache, md_ref)
    from engine_triton.kernels import attention as kernels

    orig_splits = kernels.decode_splits
    kernels.decode_splits = lambda *a: splits
    try:
        got = tri.forward(q.to(device), k.to(device), v.to(device), tri_cache, md_tri)
    finally:
        kernels.decode_splits = orig_splits
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=tol, atol=tol)
    # Both wrote the same e4m3 bytes for the new tokens (decodes inside the decode kernel).
    assert torch.equal(tri_cache.cpu().view(torch.uint8), ref_cache.view(torch.uint8))
