"""engine-triton's quantized matmuls against the torch references (``engine.kernels.quantized``),
in the interpreter on the CPU (tiny shapes) or on a GPU.

The conformance kit's cases (exact activation quantization by construction) plus the paths the
kit's sizes do not force: split-K in both skinny kernels, the FMA/dot variants, the tiled GEMMs
for more than 16 rows, act-order permutations, 8-bit weights, static activation scales. Real
model shapes are checked on a GPU in tests/gpu/test_quant_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels import quantized as ref  # noqa: E402
from engine.testing import checks  # noqa: E402
from engine.testing.inputs import _fp8_rows, _pow2  # noqa: E402


def _impls():
    # Module aliases: tests/test_gpu_tests_resolve.py resolves names file-wide, and other
    # tests here import the functions of the same names.
    from engine_triton.kernels import fp8_linear as fp8_mod
    from engine_triton.kernels import int8_linear as int8_mod
    from engine_triton.kernels import kv_cache
    from engine_triton.kernels import wna16_linear as wna16_mod

    return {
        "write_kv_cache": kv_cache.write_kv_cache,  # its cases include an FP8 cache
        "fp8_linear": fp8_mod.fp8_linear,
        "fp8_block_linear": fp8_mod.fp8_block_linear,
        "int8_linear": int8_mod.int8_linear,
        "wna16_linear": wna16_mod.wna16_linear,
    }


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(
    "name", ["fp8_linear", "fp8_block_linear", "int8_linear", "wna16_linear", "write_kv_cache"]
)
def test_conformance_cases(name, dtype, device):
    checks.check_kernel(name, _impls()[name], torch.device(device), dtype)


def _close(got, want, dtype, seed=None):
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(
        got.cpu().float(), want.float(), rtol=tol, atol=tol, msg=lambda m: f"seed={seed}: {m}"
    )


# ---- FP8 ----------------------------------------------------------------------------------------------
def test_reference_dynamic_scale_is_the_ieee_quotient_on_every_device(device):
    """The reference's ``amax / 448`` is the correctly rounded quotient on the GPU too (as the
    kernels' ``div_rn``), not torch's CUDA multiply by the reciprocal of a Python float: the
    row maxima below are ones where that product is one ulp off, and e4m3 ties then round the
    other way (bf16 activations hit ties often)."""
    inv = torch.tensor(1.0 / ref.FP8_MAX, dtype=torch.float32)
    candidates = torch.linspace(0.5, 8.0, 4001, dtype=torch.float32)
    exact = (candidates.double() / ref.FP8_MAX).float()
    off = candidates[(candidates * inv) != exact][:8]
    assert len(off) == 8  # such maxima exist (about half of all floats)
    x = torch.zeros(8, 32)
    x[:, 0] = off
    got = ref.fp8_dynamic_scale(x.to(device)).cpu()
    assert torch.equal(got[:, 0], (off.double() / ref.FP8_MAX).float())


def test_quantize_fp8_matches_the_reference(device, seed):
    """On a GPU with random values; in the interpreter with values that are exact in e4m3
    (Triton 3.6's interpreter rounds a value that should carry into the next binade, such as
    124.7 -> 128, down to the binade's start, 64: a simulator bug the GPU does not have)."""
    from engine_triton.kernels.fp8_linear import quantize_fp8

    gen = torch.Generator().manual_seed(seed)
    if device == "cuda":
        x = torch.randn(5, 96, generator=gen) * 3
    else:
        x = _fp8_rows(5, 96, gen, group=32).float() * _pow2((5, 1), -7, -4, gen)
    x[1] = 0.0  # an all-zero row: the minimum scale
    q, s = quantize_fp8(x.to(device))
    want_s = ref.fp8_dynamic_scale(x)
    torch.testing.assert_close(s.cpu(), want_s)
    assert torch.equal(q.cpu().float(), ref.fp8_quantize(x, want_s).float())
    q, s = quantize_fp8(x.to(device), group_size=32)
    want_s = ref.fp8_dynamic_scale(x, 32)
    torch.testing.assert_close(s.cpu(), want_s)
    assert torch.equal(
        q.cpu().float(), ref.fp8_quantize(x, want_s.repeat_interleave(32, 1)).float()
    )
    static = torch.tensor([2.0**-8])
    q, _ = quantize_fp8(x.to(device), static.to(device))
    assert torch.equal(q.cpu().float(), ref.fp8_quantize(x, static).float())  # saturates at 448


@pytest.mark.parametrize(
    ("m", "split", "dot", "act"),
    [(1, 1, False, True), (1, 2, False, True), (3, 4, False, True), (9, 2, True, True),
     (1, 2, False, False), (12, 1, True, False), (1, 2, True, True), (1, 1, True, False)],
)  # fmt: skip
def test_fp8_skinny_variants(m, split, dot, act, device, seed, monkeypatch):
    from engine_triton.kernels import fp8_linear as mod

    block_n, block_k = (16, 32) if dot else (4, 32)
    monkeypatch.setattr(mod, "_skinny_config", lambda *a: (block_n, block_k, 4, split, dot))
    gen = torch.Generator().manual_seed(seed)
    n, k = 24, 256
    w = _fp8_rows(n, k, gen)
    ws = _pow2((n,), -12, -9, gen)
    x = (_fp8_rows(m, k, gen).float() * _pow2((m, 1), -7, -4, gen)).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    want = ref.fp8_linear(x, w, ws, None, b, act)
    # With activation quantization: the decode default (weight-only arithmetic; x is exact in
    # e4m3 here, so both agree with the reference) and the quantizing kernel.
    for weight_only in (True, False) if act else (True,):
        monkeypatch.setattr(mod, "DECODE_WEIGHT_ONLY", weight_only)
        got = mod.fp8_linear(x.to(device), w.to(device), ws.to(device), None, b.to(device), act)
        _close(got, want, torch.bfloat16, seed)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("act", [True, False])
def test_fp8_gemm_for_more_than_16_rows(static, act, device, seed):
    from engine_triton.kernels.fp8_linear import fp8_linear

    gen = torch.Generator().manual_seed(seed)
    m, n, k = 37, 40, 96
    w = _fp8_rows(n, k, gen)
    ws = _pow2((n,), -12, -9, gen)
    if static:
        s = torch.tensor([2.0**-5])
        x = (torch.randn(m, k, generator=gen) * 96).clamp(-448, 448).to(torch.float8_e4m3fn)
        x = (x.float() * s).to(torch.bfloat16)
    else:
        s = None
        x = (_fp8_rows(m, k, gen).float() * _pow2((m, 1), -7, -4, gen)).to(torch.bfloat16)
    want = ref.fp8_linear(x, w, ws, s, None, act)
    dev_s = s.to(device) if s is not None else None
    got = fp8_linear(x.to(device), w.to(device), ws.to(device), dev_s, None, act)
    _close(got, want, torch.bfloat16, seed)


@pytest.mark.parametrize("m", [1, 20])
def test_fp8_block_scaled(m, device, seed):
    from engine_triton.kernels.fp8_linear import fp8_block_linear

    gen = torch.Generator().manual_seed(seed)
    n, k, bn, bk = 48, 64, 32, 32
    w = _fp8_rows(n, k, gen)
    scale = _pow2((-(-n // bn), k // bk), -12, -9, gen)
    x = (_fp8_rows(m, k, gen, group=bk).float() * _pow2((m, k // bk), -7, -4, gen)
         .repeat_interleave(bk, 1)).to(torch.bfloat16)  # fmt: skip
    want = ref.fp8_block_linear(x, w, scale, (bn, bk), None, True)
    got = fp8_block_linear(x.to(device), w.to(device), scale.to(device), (bn, bk), None, True)
    _close(got, want, torch.bfloat16, seed)


# ---- W4A16 / W8A16 -------------------------------------------------------------------------------------
def _wna16(n, k, bits, group, act_order, gen):
    maxq = (1 << bits) - 1
    q = torch.randint(0, maxq + 1, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.005).to(torch.float16)
    zeros = torch.randint(0, maxq + 1, (n, k // group), generator=gen, dtype=torch.uint8)
    perm = torch.randperm(k, generator=gen) if act_order else None
    return q, scales, zeros, perm


@pytest.mark.parametrize(
    ("m", "bits", "group", "split", "act_order", "tiles", "dtype"),
    [(1, 4, 32, 1, False, 1, torch.bfloat16), (1, 4, 64, 2, False, 2, torch.bfloat16),
     (1, 4, 32, 4, True, 2, torch.bfloat16), (1, 8, 32, 2, False, 4, torch.bfloat16),
     (1, 4, 32, 2, False, 8, torch.bfloat16), (1, 4, 64, 1, True, 4, torch.float16),
     (1, 8, 64, 2, True, 2, torch.float16),
     (4, 4, 32, 2, False, 0, torch.bfloat16), (16, 4, 64, 1, True, 0, torch.bfloat16),
     (7, 8, 64, 4, False, 0, torch.bfloat16), (5, 8, 32, 2, False, 0, torch.float16),
     (2, 4, 32, 1, False, 0, torch.float16)],
)  # fmt: skip
def test_wna16_skinny_variants(
    m, bits, group, split, act_order, tiles, dtype, device, seed, monkeypatch
):
    """Every path of the decode kernels: one row (several K tiles per iteration, some of them
    past the split's end and masked), 2-16 rows on the tensor cores; split K, act order, 4
    and 8 bits, and both half-precision dtypes (each with its own bit-trick offset; 8 bits in
    bfloat16 converts instead)."""
    from engine_triton.kernels import wna16_linear as wna16_mod

    block_k = 32
    monkeypatch.setattr(wna16_mod, "_gemv_config", lambda *a: (32, block_k, tiles, 4, split))
    monkeypatch.setattr(wna16_mod, "_skinny_config", lambda *a: (32, block_k, 4, split))
    gen = torch.Generator().manual_seed(seed)
    n, k = 40, 256
    q, s, z, perm = _wna16(n, k, bits, group, act_order, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    want = ref.wna16_linear(
        x, ref.wna16_linear.prepack(q, s, z, bits=bits, group_size=group, perm=perm),
        bits=bits, group_size=group, bias=b,
    )  # fmt: skip
    dev_perm = perm.to(device) if perm is not None else None
    packed = wna16_mod.wna16_linear.prepack(
        q.to(device), s.to(device), z.to(device), bits=bits, group_size=group, perm=dev_perm
    )
    got = wna16_mod.wna16_linear(
        x.to(device), packed, bits=bits, group_size=group, bias=b.to(device)
    )
    _close(got, want, dtype, seed)


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize(("bits", "act_order"), [(4, False), (4, True), (8, False)])
def test_wna16_gemm_for_more_than_16_rows(bits, act_order, dense, device, seed, monkeypatch):
    """The fused GEMM, and (``dense``) the dequantized weight through ``torch.mm`` that
    serves batches of ``DENSE_MIN_ROWS`` rows or more: that weight is rounded to the
    activation dtype, as a dense model's would be, so its reference is too (the dense
    weights themselves are compared exactly)."""
    from engine_triton.kernels import wna16_linear as wna16_mod
    from engine_triton.kernels.wna16_linear import wna16_linear

    monkeypatch.setattr(wna16_mod, "DENSE_MIN_ROWS", 17 if dense else 1 << 30)
    gen = torch.Generator().manual_seed(seed)
    m, n, k, group = 45, 136, 128, 64
    q, s, z, perm = _wna16(n, k, bits, group, act_order, gen)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(m, k, generator=gen).to(dtype)
        want = ref.wna16_linear(
            x, ref.wna16_linear.prepack(q, s, z, bits=bits, group_size=group, perm=perm),
            bits=bits, group_size=group,
        )  # fmt: skip
        dev_perm = perm.to(device) if perm is not None else None
        packed = wna16_linear.prepack(
            q.to(device), s.to(device), z.to(device), bits=bits, group_size=group, perm=dev_perm
        )
        if dense:
            g = torch.arange(k) // group
            # [N, K], input features in the stored (permuted) order
            w = ((q.float() - z.float()[:, g]) * s.float()[:, g]).to(dtype)
            got_w = wna16_mod.dequantize_t(packed, bits=bits, group_size=group, dtype=dtype)
            assert torch.equal(got_w.cpu(), w.t())
            xp = x[:, perm] if perm is not None else x
            want = (xp.float() @ w.float().t()).to(dtype)
        _close(wna16_linear(x.to(device), packed, bits=bits, group_size=group), want, dtype, seed)


@pytest.mark.parametrize("m", [100, 300])
def test_wna16_gemm_float32_activations_at_the_largest_tiles(m, device, seed, monkeypatch):
    """float32 activations at the 128-row tiles with 128-wide K steps (one scale group per
    row; 100 rows: 128x64 tiles, 300: 128x128): the configurations tuned for 16-bit
    activations take fewer pipeline stages, so that they fit in shared memory (on an H200 one
    asked for 236 KiB and failed to launch); the 16-bit configurations keep their stages."""
    from engine_triton.kernels import wna16_linear as wna16_mod

    monkeypatch.setattr(wna16_mod, "DENSE_MIN_ROWS", 1 << 30)
    assert wna16_mod._gemm_config(300, 6144, 4096, 128, 8) == (128, 128, 128, 8, 3)
    assert wna16_mod._gemm_config(100, 4096, 4096, 128, 8) == (128, 64, 128, 4, 4)
    assert wna16_mod._gemm_config(300, 6144, 4096, 128, 8, 4)[4] == 2
    assert wna16_mod._gemm_config(100, 4096, 4096, 128, 8, 4)[4] == 2
    gen = torch.Generator().manual_seed(seed)
    n, k = 136, 128
    q, s, z, _ = _wna16(n, k, 4, k, False, gen)
    x = torch.randn(m, k, generator=gen)
    want = ref.wna16_linear(
        x, ref.wna16_linear.prepack(q, s, z, bits=4, group_size=k), bits=4, group_size=k
    )
    packed = wna16_mod.wna16_linear.prepack(
        q.to(device), s.to(device), z.to(device), bits=4, group_size=k
    )
    got = wna16_mod.wna16_linear(x.to(device), packed, bits=4, group_size=k)
    _close(got, want, torch.float32, seed)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without a GPU")
def test_a_tiny_awq_model_runs_on_the_triton_kernels(tmp_path, seed):
    """The engine's AWQ path end to end with engine-triton's wna16_linear (registered for the
    cpu platform so the interpreter runs it) against the torch reference kernels."""
    from engine.kernels import KernelRegistry
    from engine.testing import quantized_models as qm
    from engine.testing.prefill import build_model as build
    from engine.testing.prefill import prefill_logits
    from engine.testing.tiny_models import save_tiny_model
    from engine_triton.kernels.wna16_linear import wna16_linear

    src = save_tiny_model(
        "llama", tmp_path / "src", hidden_size=64, intermediate_size=128, num_hidden_layers=1
    )
    ckpt, _ = qm.write_awq(src, tmp_path / "q", None, group_size=32)
    registry = KernelRegistry()
    registry.register(
        "wna16_linear", wna16_linear, platforms=("cpu",), provider="engine-llm-triton"
    )
    kernels = registry.resolve("cpu")
    got = prefill_logits(build(ckpt, kernels=kernels)[0], list(range(10, 27)))
    want = prefill_logits(
        build(ckpt, kernels=KernelRegistry().resolve("cpu"))[0], list(range(10, 27))
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
