"""engine-triton's norms and SiLU-and-mul that write e4m3 per token (``*_quant_fp8``), and
``fp8_linear`` given their output (``Fp8Activation``), in the interpreter on the CPU or on a
GPU: bit-identical to the plain kernel followed by ``quantize_fp8`` on random inputs (fp8
bytes, scales, residual), odd row counts, zero rows, rows wider than one block; and a tiny
FP8 Llama on these kernels gives the same logits fused and unfused. (Against the torch
references, with inputs exact in e4m3, through the conformance kit: test_conformance_cases.)
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.testing import checks  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _same(got: torch.Tensor, want: torch.Tensor, what: str, seed: int) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff = (_bits(got) != _bits(want)).sum().item()
    assert diff == 0, f"seed={seed}: {what} differs in {diff} of {got.numel()} values"


@pytest.mark.parametrize("name", ["rms_norm_quant_fp8", "fused_add_rms_norm_quant_fp8"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_norm_conformance_cases(name, dtype, device):
    from engine_triton.kernels import norm

    checks.check_kernel(name, getattr(norm, name), torch.device(device), dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_silu_conformance_cases(dtype, device):
    from engine_triton.kernels import activation

    checks.check_kernel(
        "silu_and_mul_quant_fp8", activation.silu_and_mul_quant_fp8, torch.device(device), dtype
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(0, 64), (1, 64), (7, 96), (19, 256), (33, 4096)])
@pytest.mark.parametrize("residual", [False, True])
def test_norm_quant_is_the_norm_then_quantize_fp8(rows, hidden, residual, dtype, device, seed):
    from engine_triton.kernels import norm
    from engine_triton.kernels.fp8_linear import quantize_fp8

    x = (torch.randn(rows, hidden) * 3).to(dtype).to(device)
    res = torch.randn(rows, hidden).to(dtype).to(device)
    weight = (1 + 0.2 * torch.randn(hidden)).to(dtype).to(device)
    if rows:
        x[0] = 0  # an all-zero row takes the minimum scale (without a residual)
    if residual:
        q, scale, new_res = norm.fused_add_rms_norm_quant_fp8(x, res, weight, 1e-6)
        y, want_res = norm.fused_add_rms_norm(x, res, weight, 1e-6)
        _same(new_res, want_res, "residual", seed)
    else:
        q, scale = norm.rms_norm_quant_fp8(x, weight, 1e-6)
        y = norm.rms_norm(x, weight, 1e-6)
    want_q, want_scale = quantize_fp8(y.reshape(-1, hidden))
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    _same(q, want_q, "e4m3 values", seed)
    _same(scale, want_scale, "scales", seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(0, 48), (1, 128), (5, 5000), (19, 96), (17, 8192)])
def test_silu_and_mul_quant_is_silu_and_mul_then_quantize_fp8(rows, inter, dtype, device, seed):
    """Widths over one 4096-wide chunk (5000: a partial last chunk) check both passes."""
    from engine_triton.kernels import activation
    from engine_triton.kernels.fp8_linear import quantize_fp8

    x = (torch.randn(rows, 2 * inter) * 3).to(dtype).to(device)
    if rows:
        x[0] = 0
    q, scale = activation.silu_and_mul_quant_fp8(x)
    want_q, want_scale = quantize_fp8(activation.silu_and_mul(x).reshape(-1, inter))
    _same(q, want_q, "e4m3 values", seed)
    _same(scale, want_scale, "scales", seed)


@pytest.mark.parametrize("rows", [17, 40])
def test_fp8_linear_given_fp8_activation_is_the_same_product(rows, device, seed):
    """From 17 rows fp8_linear quantizes x per token itself; given that quantization as an
    Fp8Activation it computes the same product, bit for bit."""
    from engine.kernels.quantized import Fp8Activation
    from engine.testing.inputs import _fp8_rows
    from engine_triton.kernels import fp8_linear as mod

    assert mod.fp8_linear.fp8_activation_min_rows == mod.MAX_SKINNY_M + 1
    n, k = 48, 128
    w = _fp8_rows(n, k, torch.Generator().manual_seed(seed)).to(device)
    ws = (torch.rand(n) * 1e-3 + 1e-4).to(device)
    bias = torch.randn(n).to(torch.bfloat16).to(device)
    x = torch.randn(rows, k).to(torch.bfloat16).to(device)
    q, scale = mod.quantize_fp8(x)
    got = mod.fp8_linear(Fp8Activation(q, scale, x.dtype), w, ws, None, bias, True)
    want = mod.fp8_linear(x, w, ws, None, bias, True)
    assert got.dtype == torch.bfloat16
    _same(got, want, "product", seed)


def test_a_tiny_fp8_llama_on_triton_kernels_is_identical_fused_and_unfused(
    tmp_path, device, monkeypatch
):
    """Online FP8, W8A8 forced on, engine-triton's kernels: every pair is linked (the fused
    ops come from the provider of the plain ones), a 22-token prefill (above the 16-row
    threshold) runs one quantize_fp8 per layer (o_proj's) instead of four, and the logits
    are the unfused model's to the bit."""
    from engine.kernels import KernelRegistry
    from engine.layers.fp8_input import link_fp8_inputs, unlink_fp8_inputs
    from engine.testing.prefill import build_model as build
    from engine.testing.prefill import prefill_logits
    from engine.testing.tiny_models import save_tiny_model
    from engine_triton.kernels import fp8_linear as mod
    from engine_triton.kernels import register

    layers = 2
    path = save_tiny_model(
        "llama",
        tmp_path,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        initializer_range=0.1,
    )
    registry = KernelRegistry()
    register(registry, platforms=(device,))
    kernels = registry.resolve(device)
    model, _ = build(
        path, "fp8", dtype="bfloat16", activation_quant=True, kernels=kernels, device=device
    )
    links = link_fp8_inputs(model)
    assert len(links) == 3 * layers and all(not r for r in links.values()), links

    calls = []
    quantize = mod.quantize_fp8
    monkeypatch.setattr(mod, "quantize_fp8", lambda *a, **kw: calls.append(1) or quantize(*a, **kw))
    fused = prefill_logits(model)
    fused_calls = len(calls)
    unlink_fp8_inputs(model)
    calls.clear()
    plain = prefill_logits(model)
    assert (fused_calls, len(calls)) == (layers, 4 * layers)
    assert torch.equal(fused, plain), float((fused - plain).abs().max())
