"""GGUF kept quantized on a CUDA GPU: engine-triton's ``gguf_linear`` at Gemma 3 270M and
Llama-3.1-8B projection sizes against the dequantized product (``gguf.quants.dequantize``), and a
tiny GGUF model through the whole engine (CUDA graphs, Triton attention and kernels) against
the same file dequantized at load (``--quantization none``)."""

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


def test_tiny_gguf_through_the_engine_matches_the_dequantized_file(tmp_path):
    from engine import LLM, SamplingParams
    from engine.testing.tiny_gguf import MIXED_TYPES, write_tiny_gemma3_gguf

    path = write_tiny_gemma3_gguf(
        tmp_path / "k.gguf", seed=3, types=MIXED_TYPES, hidden_size=256, intermediate_size=512
    )
    prompts = [{"prompt_token_ids": p} for p in ([2, 9, 11, 40, 3], [2, 100], list(range(10, 60)))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = []
    for quantization in (None, "none"):
        llm = LLM(
            model=str(path), dtype="float32", quantization=quantization, num_gpu_blocks_override=256
        )
        kept = llm.llm_engine.runner.model.model.layers[0].self_attn.qkv_proj.quant_method
        assert kept.name == ("gguf Q4_K/Q6_K" if quantization is None else "unquantized")
        tokens.append(
            [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        )
        assert llm.llm_engine.num_used_blocks == 0
        del llm
    assert tokens[0] == tokens[1]
