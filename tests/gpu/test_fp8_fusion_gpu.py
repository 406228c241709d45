"""FP8 activations written by the norms and SiLU-and-mul (``engine.layers.fp8_input``) on a
CUDA GPU with FP8 (sm_89+): the fused kernels at Llama-3.1-8B widths bit-identical to the
plain kernel + ``quantize_fp8``; tiny Llama-family FP8 models identical fused and unfused,
once as a prefill (cuBLASLt's FP8 GEMM) and once through the whole engine with CUDA graphs
capturing decode batches above the 16-row threshold."""

from __future__ import annotations

import gc
import random

import pytest
import torch

pytestmark = pytest.mark.gpu


def _needs_fp8() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 W8A8 needs sm_89 or newer")


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    bits = (lambda t: t.view(torch.uint8)) if got.element_size() == 1 else (lambda t: t)
    diff = int((bits(got) != bits(want)).sum())
    assert diff == 0, f"{what} differs in {diff} of {got.numel()} values"


@pytest.mark.parametrize("rows", [17, 256, 300])
def test_fused_kernels_at_8b_widths_are_the_plain_kernels_then_quantize_fp8(rows, seed):
    _needs_fp8()
    from engine_triton.kernels import activation, norm
    from engine_triton.kernels.fp8_linear import quantize_fp8

    bf16 = torch.bfloat16
    x = torch.randn(rows, 4096, device="cuda", dtype=bf16) * 4
    res = torch.randn(rows, 4096, device="cuda", dtype=bf16)
    w = (1 + 0.2 * torch.randn(4096, device="cuda")).to(bf16)
    q, scale, new_res = norm.fused_add_rms_norm_quant_fp8(x, res, w, 1e-5)
    y, want_res = norm.fused_add_rms_norm(x, res, w, 1e-5)
    want_q, want_scale = quantize_fp8(y)
    _same(new_res, want_res, f"residual (seed {seed})")
    _same(q, want_q, f"norm e4m3 (seed {seed})")
    _same(scale, want_scale, f"norm scales (seed {seed})")

    q, scale = norm.rms_norm_quant_fp8(x, w, 1e-5)
    want_q, want_scale = quantize_fp8(norm.rms_norm(x, w, 1e-5))
    _same(q, want_q, f"first norm e4m3 (seed {seed})")
    _same(scale, want_scale, f"first norm scales (seed {seed})")

    gate_up = torch.randn(rows, 2 * 14336, device="cuda", dtype=bf16) * 3
    q, scale = activation.silu_and_mul_quant_fp8(gate_up)
    want_q, want_scale = quantize_fp8(activation.silu_and_mul(gate_up))
    _same(q, want_q, f"silu e4m3 (seed {seed})")
    _same(scale, want_scale, f"silu scales (seed {seed})")


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def fp8_model(request, tmp_path_factory):
    from engine.testing.tiny_models import build_tiny_model

    # Widths that are multiples of 16: the W8A8 products go through cuBLASLt.
    return str(
        build_tiny_model(
            tmp_path_factory.mktemp(request.param),
            request.param,
            hidden_size=256,
            intermediate_size=512,
            num_heads=4,
            num_kv_heads=2,
        )
    )


def test_fp8_prefill_logits_identical_fused_and_unfused(fp8_model):
    _needs_fp8()
    from engine.layers.fp8_input import link_fp8_inputs, unlink_fp8_inputs
    from engine.testing.prefill import PROMPT, build_model, prefill_logits

    # build_model's spec carries no capability, so W8A8 is asked for (_needs_fp8 checked it).
    model, _ = build_model(fp8_model, "fp8", dtype="bfloat16", device="cuda", activation_quant=True)
    links = link_fp8_inputs(model)
    assert links and all(not r for r in links.values()), links
    prompt = PROMPT * 3  # 66 rows: above the 16-row threshold
    fused = prefill_logits(model, prompt)
    unlink_fp8_inputs(model)
    plain = prefill_logits(model, prompt)
    assert torch.equal(fused, plain), float((fused - plain).abs().max())


def test_fp8_engine_with_cuda_graphs_identical_fused_and_unfused(tmp_path, monkeypatch):
    """40 requests decode together (batches of up to 40 rows, captured in CUDA graphs): the
    greedy tokens and their logprobs with the fusion linked equal those without it, and the
    fused kernels did run. The unfused engine runs twice first: if it does not repeat itself
    (a non-deterministic kernel), comparing the fused one to it would prove nothing."""
    _needs_fp8()
    import engine.layers.fp8_input as fp8_input
    from engine import LLM, SamplingParams
    from engine.testing.tiny_models import build_tiny_model
    from engine_triton.kernels import norm

    path = str(
        build_tiny_model(tmp_path, "llama", hidden_size=256, intermediate_size=512, num_heads=4,
                         num_kv_heads=2)
    )  # fmt: skip
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(10, 300) for _ in range(rng.randrange(1, 90))]}
        for _ in range(40)
    ]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    calls = []
    fused_op = norm.fused_add_rms_norm_quant_fp8
    monkeypatch.setattr(
        norm, "fused_add_rms_norm_quant_fp8", lambda *a: calls.append(1) or fused_op(*a)
    )
    link = fp8_input.link_fp8_inputs

    def run(linked: bool):
        def linker(model):
            result = link(model)
            if not linked:
                fp8_input.unlink_fp8_inputs(model)
            return result

        monkeypatch.setattr(fp8_input, "link_fp8_inputs", linker)
        llm = LLM(path, quantization="fp8", dtype="bfloat16", num_gpu_blocks_override=512)
        assert llm.llm_engine.runner.graphs is not None, "CUDA graphs are off"
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        logprobs = [
            [o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(o.outputs[0].token_ids)]
            for o in outs
        ]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return tokens, logprobs

    plain = run(False)
    # (The engine's own spec has the device's capability: W8A8 on sm_89+ with no forcing.)
    if run(False) != plain:
        pytest.skip("the unfused FP8 engine is not deterministic run to run on this GPU")
    assert not calls
    fused = run(True)
    assert calls, "the fused norm kernel never ran"
    assert fused[0] == plain[0]
    assert fused[1] == plain[1]
