"""engine-llm-cpu's kernel overrides: the torch forms exactly the reference's results, the
compiled norms (engine_cpu/csrc/cpu_ops.c) the reference's to float32 rounding (the
conformance kit checks them on random inputs too; these are the cases that tell the ops
apart)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import reference as ref
from engine.plugins import default_plugin_manager


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_argmax_is_torch_argmax_with_ties_nan_and_inf(dtype):
    from engine_cpu.kernels import argmax

    torch.manual_seed(0)
    # Coarse values: bf16 logits tie often, and the first maximum must win.
    x = (torch.randn(40, 5003) * 2).round().to(dtype)
    x[1] = float("-inf")  # all -inf: index 0
    x[2, 17] = float("nan")  # a NaN counts as the maximum
    x[3, 4000] = x[3, 9] = x[3].max() + 1  # a tie far apart
    x[4] = 0.0  # all equal
    # and a padded-vocabulary view (row stride != V), one row (float32: the compiled kernel's
    # one-thread case), rows shorter than its eight lanes
    for logits in (x, x[:, :4999], x[2:3], x[3:4], x[:, :5]):
        out = argmax(logits)
        assert out.dtype == torch.int64
        assert torch.equal(out, ref.argmax(logits))
    assert argmax(x)[[1, 2, 3, 4]].tolist() == [0, 17, 9, 0]


def test_the_cpu_platform_uses_the_override():
    kernels = default_plugin_manager().kernel_registry().resolve("cpu")
    assert kernels.impls["argmax"].provider == "engine-llm-cpu"
    assert kernels.impls["argmax"].fn.__module__ == "engine_cpu.kernels"


def _strided_heads(t: int, heads: int, d: int, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """A [t, heads, d] view with padded rows, as q/k norms see the fused qkv output."""
    return (
        (torch.randn(t, (heads + 3) * d) * scale)
        .to(dtype)[:, d : (heads + 1) * d]
        .view(t, heads, d)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("weight_dtype", ["float32", "same"])
def test_rms_norms_are_the_reference_bit_for_bit(dtype, weight_dtype, torch_cpu_kernels):
    from engine_cpu.norms import fused_add_rms_norm, rms_norm

    torch.manual_seed(0)
    for t, h in ((1, 640), (16, 640), (7, 100), (33, 1152), (3, 7)):
        for scale in (1e-3, 1.0, 300.0):
            wdt = torch.float32 if weight_dtype == "float32" else dtype
            w = (1.0 + 0.3 * torch.randn(h)).to(wdt)
            x = (torch.randn(t, h) * scale).to(dtype)
            r = (torch.randn(t, h) * scale).to(dtype)
            for eps in (1e-6, 1e-5):
                assert torch.equal(rms_norm(x, w, eps), ref.rms_norm(x, w, eps))
                out, res = fused_add_rms_norm(x, r, w, eps)
                ref_out, ref_res = ref.fused_add_rms_norm(x, r, w, eps)
                assert torch.equal(out, ref_out) and torch.equal(res, ref_res)
        heads = _strided_heads(t, 4, 64, dtype, 2.0)  # per-head norm of a strided view
        w = (1.0 + 0.3 * torch.randn(64)).to(wdt)
        assert torch.equal(rms_norm(heads, w, 1e-6), ref.rms_norm(heads, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("norm", ["float32", "same", None])
@pytest.mark.parametrize("is_neox, rot_frac", [(True, 1.0), (False, 1.0), (True, 0.5)])
def test_qk_norm_rotary_is_the_reference_bit_for_bit(
    dtype, norm, is_neox, rot_frac, torch_cpu_kernels
):
    """In place into column slices of one fused qkv output; Gemma 3 270M's shape (4 query
    heads, 1 KV head, 256 dims) among them; the layouts the override hands to the reference
    (interleaved pairs, partial rotary) too."""
    from engine.testing.inputs import rope_cache
    from engine_cpu.norms import qk_norm_rotary

    torch.manual_seed(0)
    for t, h, hkv, d in ((1, 4, 1, 256), (16, 4, 1, 256), (5, 4, 2, 64), (3, 8, 8, 128)):
        rot = int(d * rot_frac)
        cache = rope_cache(4096, rot)
        positions = torch.randint(0, 4096, (t,))
        qkv = (torch.randn(t, (h + 2 * hkv) * d) * 4).to(dtype)
        wdt = None if norm is None else torch.float32 if norm == "float32" else dtype
        qw, kw = ((1.0 + 0.3 * torch.randn(d)).to(wdt) for _ in range(2)) if wdt else (None, None)
        ours, theirs = qkv.clone(), qkv.clone()
        args = (cache, d, is_neox, qw, kw, 1e-6)
        q, k = qk_norm_rotary(positions, ours[:, : h * d], ours[:, h * d : (h + hkv) * d], *args)
        ref.qk_norm_rotary(positions, theirs[:, : h * d], theirs[:, h * d : (h + hkv) * d], *args)
        assert torch.equal(ours, theirs)  # query/key written in place, values untouched
        assert q.data_ptr() == ours.data_ptr() and k.data_ptr() == ours[:, h * d :].data_ptr()


def test_the_cpu_platform_uses_the_norm_overrides():
    kernels = default_plugin_manager().kernel_registry().resolve("cpu")
    for name in ("rms_norm", "fused_add_rms_norm", "qk_norm_rotary"):
        assert kernels.impls[name].provider == "engine-llm-cpu"
        assert kernels.impls[name].fn.__module__ == "engine_cpu.norms"


def _compiled(monkeypatch) -> None:
    """The compiled norms (the avx2 family), or a skip saying why they are not here."""
    from engine_cpu import native

    monkeypatch.setenv("ENGINE_CPU_NATIVE", "avx2")
    if native.load("avx2") is None:
        pytest.skip(f"no AVX2 kernels here: {native.unavailable_reason('avx2')}")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: within a few ulps of the largest value (eight-lane sums and fused multiply-adds
    against torch's order; the rotary's differences can cancel); bfloat16: the same value, or
    one bfloat16 step where the float32 results straddle a rounding point."""
    assert got.dtype == want.dtype and got.shape == want.shape
    top = float(want.float().abs().max())
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6 * top)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-8 * top)
        assert float((got != want).float().mean()) < 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_rms_norms_match_the_reference(dtype, monkeypatch):
    from engine_cpu.norms import fused_add_rms_norm, rms_norm

    _compiled(monkeypatch)
    torch.manual_seed(0)
    for t, h in ((1, 640), (16, 640), (7, 100), (33, 1152), (3, 7)):
        for scale in (1e-3, 1.0, 300.0):
            w = 1.0 + 0.3 * torch.randn(h)
            x = (torch.randn(t, h) * scale).to(dtype)
            r = (torch.randn(t, h) * scale).to(dtype)
            _close(rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
            out, res = fused_add_rms_norm(x, r, w, 1e-6)
            ref_out, ref_res = ref.fused_add_rms_norm(x, r, w, 1e-6)
            assert torch.equal(res, ref_res)  # one rounded add
            _close(out, ref_out)
            # a strided input (a column slice) and a bf16 weight go the same way
            wide = (torch.randn(t, h + 5) * scale).to(dtype)[:, 2 : h + 2]
            _close(rms_norm(wide, w.to(dtype), 1e-5), ref.rms_norm(wide, w.to(dtype), 1e-5))
        heads = _strided_heads(t, 4, 64, dtype, 2.0)
        w = 1.0 + 0.3 * torch.randn(64)
        _close(rms_norm(heads, w, 1e-6), ref.rms_norm(heads, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", [True, False])
def test_compiled_qk_norm_rotary_matches_the_reference(dtype, norm, monkeypatch):
    from engine.testing.inputs import rope_cache
    from engine_cpu.norms import qk_norm_rotary

    _compiled(monkeypatch)
    torch.manual_seed(0)
    for t, h, hkv, d in ((1, 4, 1, 256), (16, 4, 1, 256), (5, 4, 2, 64), (3, 8, 8, 128)):
        cache = rope_cache(4096, d)
        positions = torch.randint(0, 4096, (t,))
        qkv = (torch.randn(t, (h + 2 * hkv) * d) * 4).to(dtype)
        qw, kw = (1.0 + 0.3 * torch.randn(d) for _ in range(2)) if norm else (None, None)
        ours, theirs = qkv.clone(), qkv.clone()
        args = (cache, d, True, qw, kw, 1e-6)
        qk_norm_rotary(positions, ours[:, : h * d], ours[:, h * d : (h + hkv) * d], *args)
        ref.qk_norm_rotary(positions, theirs[:, : h * d], theirs[:, h * d : (h + hkv) * d], *args)
        _close(ours, theirs)
        assert torch.equal(ours[:, (h + hkv) * d :], qkv[:, (h + hkv) * d :])  # values untouched
