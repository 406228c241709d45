"""GGUF kept quantized on a CUDA GPU: engine-triton's ``gguf_linear`` at Gemma 3 270M and
Llama-3.1-8B projection sizes against the dequantized product (``gguf.quants.dequantize``), and a
tiny GGUF model through the whole engine (CUDA graphs, Triton attention and kernels) against
the same file dequantized at load (``--quantization none``). GGUF MoE experts on the GPU
(``fused_moe_wna16`` with float offsets): a Qwen3-30B-A3B-sized Q4_K_M layer against the
blocks' exact weights, and a tiny Qwen3-MoE GGUF through the engine against its dequantized
twin."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.kernels import gguf as ref
from engine.testing.tiny_gguf import RANDOM_BLOCK_TYPES, random_blocks

pytestmark = pytest.mark.gpu

# (N, K): Gemma 3 270M qkv, o, gate_up, down; Llama-3.1-8B qkv and down.
SHAPES = [(1536, 640), (640, 1024), (4096, 640), (640, 2048), (6144, 4096), (4096, 14336)]


# A type only where its block fits the row: the K-quants' 256-value super-blocks do not divide
# Gemma's 640 (llama.cpp stores those tensors in Q5_0/Q8_0), which the first GPU run hit.
CASES = [
    (name, n, k)
    for name in RANDOM_BLOCK_TYPES
    for n, k in SHAPES
    if k % ref.gguf_type(name).block_size == 0
]


@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("name,n,k", CASES)
def test_gguf_linear_at_model_sizes(name, n, k, m):
    from engine_triton.kernels.gguf_linear import gguf_linear

    t = ref.gguf_type(name)
    raw = random_blocks(n, k, name, seed=n + k)
    w = torch.from_numpy(dequantize(raw, GGMLQuantizationType[name]).copy()).cuda()
    blocks = torch.from_numpy(raw).view(n, k // t.block_size, t.type_size).cuda()
    x = torch.randn(m, k, device="cuda")
    packed = gguf_linear.prepack(blocks, qtype=t.ggml_type, dtype=torch.bfloat16)
    want = x @ w.T
    got = gguf_linear(x.bfloat16(), packed, qtype=t.ggml_type).float()
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 2e-2, f"{name} [{n}x{k}] m={m}: relative error {err:.3g}"
    got32 = gguf_linear(x, packed, qtype=t.ggml_type)
    torch.testing.assert_close(got32, want, rtol=1e-3, atol=1e-3)


def _kept_and_dequantized_tokens(path, check) -> list[list[list[int]]]:
    """Greedy tokens of three prompts from ``path`` kept quantized (the default) and
    dequantized at load (``--quantization none``), float32; ``check(model, kept)`` looks at
    each loaded model; no KV block may stay in use."""
    from engine import LLM, SamplingParams

    prompts = [{"prompt_token_ids": p} for p in ([2, 9, 11, 40, 3], [2, 100], list(range(10, 60)))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = []
    for quantization in (None, "none"):
        llm = LLM(
            model=str(path), dtype="float32", quantization=quantization, num_gpu_blocks_override=256
        )
        check(llm.llm_engine.runner.model, quantization is None)
        tokens.append(
            [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        )
        assert llm.llm_engine.num_used_blocks == 0
        del llm
    return tokens


def test_tiny_gguf_through_the_engine_matches_the_dequantized_file(tmp_path):
    from engine.testing.tiny_gguf import MIXED_TYPES, write_tiny_gemma3_gguf

    path = write_tiny_gemma3_gguf(
        tmp_path / "k.gguf", seed=3, types=MIXED_TYPES, hidden_size=256, intermediate_size=512
    )

    def check(model, kept):
        method = model.model.layers[0].self_attn.qkv_proj.quant_method
        assert method.name == ("gguf Q4_K/Q6_K" if kept else "unquantized")

    kept, dequantized = _kept_and_dequantized_tokens(path, check)
    assert kept == dequantized


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q5_K")])
def test_gguf_moe_layer_at_qwen3_30b_a3b_size(types, seed):
    """128 experts, top-8, hidden 2048, 768 wide, bf16 activations; the decode and the grouped
    kernels (1 to 300 tokens) against ``fused_moe`` on the stacks' exact float32 weights."""
    from engine.benchmarks.gguf_moe_cpu import build_gguf_moe_layer
    from engine.kernels import reference as kref
    from engine.plugins import PluginManager

    kernels = PluginManager.from_env().kernel_registry().resolve("cuda")
    with torch.device("cuda"):
        layer, stacks = build_gguf_moe_layer(
            types, seed=seed % 1000, kernels=kernels, integer=True, dtype=torch.bfloat16
        )
    dense = {}
    for proj, raw in stacks.items():
        e, rows, _, size = raw.shape
        name = types[("gate", "up", "down").index(proj)]
        dense[proj] = ref.dequantize(raw.cuda().reshape(e * rows, -1, size), name).view(e, rows, -1)
    w13 = torch.cat([dense.pop("gate"), dense.pop("up")], dim=1)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for t in (1, 4, 64, 300):
        x = torch.randn(t, 2048, device="cuda", generator=gen).bfloat16()
        logits = torch.randn(t, 128, device="cuda", generator=gen)
        with torch.inference_mode():
            weights, ids = layer.select_experts(logits)
            got = layer.quant_method.apply(layer, x, weights, ids).float()
        want = kref.fused_moe(x, w13, dense["down"], weights, ids).float()
        err = float((got - want).abs().max() / want.abs().max())
        assert err < 2e-2, f"{seed} {types} T={t}: relative error {err:.3g}"


def test_tiny_gguf_moe_through_the_engine_matches_the_dequantized_file(tmp_path):
    """A Qwen3-MoE GGUF (Q4_K gate/up, Q6_K down experts) run with its experts kept (the
    fused kernel, CUDA graphs) and dequantized at load: the same greedy tokens."""
    from engine.layers.fused_moe import moe_layers
    from engine.quantization.gguf_moe import GGUFMoEMethod
    from engine.testing.tiny_gguf import MOE_TYPES, tiny_moe_hf, write_tiny_moe_gguf

    # K-quant rows: hidden and expert width multiples of 256.
    hf = tiny_moe_hf("qwen3_moe", hidden_size=256, moe_intermediate_size=256, head_dim=64)
    types = {**MOE_TYPES, "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q6_K"}
    path = write_tiny_moe_gguf(tmp_path / "moe.gguf", hf, types)

    def check(model, kept):
        methods = [m.quant_method for m in moe_layers(model)]
        assert [isinstance(m, GGUFMoEMethod) and m.integer for m in methods] == [kept] * 2

    kept, dequantized = _kept_and_dequantized_tokens(path, check)
    assert kept == dequantized
