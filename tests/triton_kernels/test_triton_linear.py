"""engine-llm-triton's skinny GEMM (decode-sized ``linear``) against ``F.linear`` in float32 math.

Odd M, N and K (masks, clamped rows and features), every inner-product variant and split-K,
fresh random inputs; sizes stay tiny for the interpreter. The real model shapes are checked on
a GPU in tests/gpu/test_triton_gpu.py.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

# The parametrization below reads the kernel module's configs at collection time.
pytest.importorskip("triton")

TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    # One rounding of the float32 result, plus summation-order noise.
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


def _inputs(m, n, k, dtype, bias, device):
    x = torch.randn(m, k).to(dtype)
    w = (torch.randn(n, k) * k**-0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    dev = [t.to(device) if t is not None else None for t in (x, w, b)]
    return (x, w, b), dev


def _expected(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float())


def _check(out, expected, dtype, seed):
    torch.testing.assert_close(
        out.cpu().float(), expected, **TOL[dtype], msg=lambda m: f"seed={seed}: {m}"
    )


def _configs():
    from engine_triton.kernels.linear import SkinnyConfig as C

    return {
        "fma": C(16, 32, 4, 1),
        "fma-n4-split3": C(4, 16, 2, 1, split_k=3),
        "dot": C(16, 32, 4, 1, dot=True),
        "dot-split2": C(16, 16, 4, 1, split_k=2, dot=True),
        "heuristic": None,
    }


@pytest.mark.parametrize("cfg_name", list(_configs()))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 2, 5, 11, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_skinny_linear_matches_f_linear(dtype, m, bias, cfg_name, device, seed):
    from engine_triton.kernels.linear import skinny_linear

    n, k = 37, 100  # neither a multiple of any block
    (x, w, b), (xd, wd, bd) = _inputs(m, n, k, dtype, bias, device)
    out = skinny_linear(xd, wd, bd, config=_configs()[cfg_name])
    assert out.shape == (m, n) and out.dtype == dtype
    _check(out, _expected(x, w, b), dtype, seed)


@pytest.mark.parametrize("dot", [False, True])
def test_even_k_and_strided_operands(dot, device, seed):
    """K a multiple of BLOCK_K * SPLIT_K (the unmasked loop); x rows and weight rows with a
    stride larger than K (column slices of bigger matrices)."""
    from engine_triton.kernels.linear import SkinnyConfig, skinny_linear

    m, n, k, dtype = 3, 40, 128, torch.bfloat16
    big_x = torch.randn(m, k + 24).to(dtype)
    big_w = (torch.randn(n, k + 8) * k**-0.5).to(dtype)
    x, w = big_x[:, :k], big_w[:, 8:]
    cfg = SkinnyConfig(16, 32, 4, 1, split_k=2, dot=dot)
    out = skinny_linear(big_x.to(device)[:, :k], big_w.to(device)[:, 8:], config=cfg)
    _check(out, _expected(x, w, None), dtype, seed)


def test_split_k_leaves_counters_zeroed_for_the_next_launch(device, seed):
    """The last program of each feature block resets its arrival counter, so repeated launches
    (CUDA-graph replays) need no memset."""
    from engine_triton.kernels.linear import _SCRATCH, SkinnyConfig, skinny_linear

    cfg = SkinnyConfig(8, 16, 2, 1, split_k=4)
    for _ in range(3):
        (x, w, b), (xd, wd, bd) = _inputs(2, 29, 64, torch.float32, True, device)
        _check(skinny_linear(xd, wd, bd, config=cfg), _expected(x, w, b), torch.float32, seed)
        assert int(_SCRATCH.counters[xd.device][:8].abs().sum()) == 0


def test_dispatch_rule(monkeypatch, seed):
    """``linear`` takes the kernel only for 2-D bf16/fp16 inputs of 1..16 rows on a CUDA device
    with unit-stride K; everything else is exactly ``F.linear``."""
    from engine_triton.kernels import linear as mod

    x = torch.randn(4, 24).bfloat16()
    w = torch.randn(10, 24).bfloat16()
    b = torch.randn(10).bfloat16()
    assert not mod.use_skinny(x, w, b)  # a CPU tensor: never the kernel outside tests
    monkeypatch.setattr(mod, "DEVICE_TYPES", ("cuda", "cpu"))
    assert mod.use_skinny(x, w, b) and mod.use_skinny(x, w, None)
    assert mod.use_skinny(x[:1], w, b) and mod.use_skinny(x.half(), w.half(), None)
    assert mod.use_skinny(torch.randn(16, 24).bfloat16(), w, b)
    refused = {
        "17 rows": (torch.randn(17, 24).bfloat16(), w, b),
        "no rows": (x[:0], w, b),
        "3-D": (x.view(2, 2, 24), w, b),
        "1-D": (x[0], w, b),
        "float32": (x.float(), w.float(), b.float()),
        "mixed dtypes": (x, w.half(), b),
        "bias dtype": (x, w, b.float()),
        "strided K (x)": (torch.randn(4, 48).bfloat16()[:, ::2], w, b),
        "strided K (weight)": (x, torch.randn(10, 48).bfloat16()[:, ::2], b),
        "transposed weight": (x, torch.randn(24, 10).bfloat16().t(), b),
    }
    for why, args in refused.items():
        assert not mod.use_skinny(*args), why

    # Shapes measured slower than cuBLAS, and unmeasured ones of several rows, stay on cuBLAS.
    assert mod.prefers_cublas(4, 10, 24) and not mod.prefers_cublas(1, 10, 24)
    assert mod.TUNED[(1, 28672, 4096)] is None and mod.prefers_cublas(1, 28672, 4096)
    assert mod.TUNED[(1, 1024, 2048)] is not None and not mod.prefers_cublas(1, 1024, 2048)

    calls = []
    real = mod.skinny_linear
    monkeypatch.setattr(mod, "skinny_linear", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(mod, "prefers_cublas", lambda m, n, k: False)
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        x, w, b = x.cuda(), w.cuda(), b.cuda()  # the GPU run of this file: a real launch
    got = mod.linear(x, w, b)
    assert calls == [1]
    x, w, b = x.cpu(), w.cpu(), b.cpu()
    _check(got, _expected(x, w, b), torch.bfloat16, seed)
    for why, args in refused.items():
        if why not in ("mixed dtypes", "bias dtype"):  # F.linear refuses those itself
            assert torch.equal(mod.linear(*args), F.linear(*args)), why
    assert calls == [1]


def test_heuristic_configs_are_well_formed():
    from engine_triton.kernels import linear as mod

    shapes = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024),
              (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
              (37, 100)]  # fmt: skip
    for m in (1, 2, 3, 4, 5, 8, 9, 16):
        for n, k in shapes:
            cands = mod.candidate_configs(m, n, k)
            assert mod.config_for(m, n, k) in cands  # measured, or the rule's
            cfg = mod._rule_of_thumb(mod.m_bucket(m), n, k, 132)
            assert cfg.split_k >= 1 and cfg.block_n >= 4 and cfg.block_k >= 16
            if cfg.dot:
                assert cfg.block_n >= 16
            if cfg.split_k > 1:  # a split that leaves K unmasked
                assert k % (cfg.block_k * cfg.split_k) == 0
            if (n, k) != (37, 100):
                # Enough programs to fill 132 SMs at least about twice.
                assert mod.triton.cdiv(n, cfg.block_n) * cfg.split_k >= 2 * 132, (m, n, k, cfg)
    key = (mod.m_bucket(3), 1024, 2048)
    tuned = mod.SkinnyConfig(32, 64, 2, 2)
    saved = mod.TUNED.get(key, "absent")
    mod.TUNED[key] = tuned
    try:
        assert mod.config_for(3, 1024, 2048) is tuned and mod.config_for(1, 1024, 2048) != tuned
    finally:
        if saved == "absent":
            del mod.TUNED[key]
        else:
            mod.TUNED[key] = saved
    assert [mod.m_bucket(m) for m in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]


def test_linear_benchmark_sweep_runs(monkeypatch, capsys):
    """``python -m engine_triton.benchmark --linear-only`` end to end on one tiny shape, with the
    GPU timers stubbed (the numbers are meaningless here; the code path is what is checked)."""
    import types

    import triton.testing

    from engine_triton import benchmark

    if torch.cuda.is_available():
        pytest.skip("runs for real on a GPU: python -m engine_triton.benchmark --linear-only")
    monkeypatch.setattr(benchmark, "LINEAR_SHAPES", {"tiny qkv": (40, 128, 2)})
    monkeypatch.setattr(benchmark, "_graph_us", lambda call: (call(0), call(1), 1.0)[-1])
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 0.002)[-1])
    props = types.SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "interpreter")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    results: dict = {}
    benchmark.sweep_linear(results, ms=(1, 3), device="cpu")
    out = capsys.readouterr().out
    assert "tiny qkv" in out and "heuristic" in out and "per decode step" in out
    rows = results["linear tiny qkv M=3 N=40 K=128"]
    assert rows[0]["config"] == "F.linear" and len(rows) > 2
    assert all("error" not in r and r["max_err"] < 0.05 for r in rows), rows
    assert sum(r.get("heuristic", False) for r in rows) == 1
