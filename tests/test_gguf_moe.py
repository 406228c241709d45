"""GGUF mixture-of-experts files (Qwen3-MoE ``qwen3moe``, Qwen2-MoE ``qwen2moe``, Mixtral as a
``llama`` with experts) written with the ``gguf`` library the way llama.cpp's converter writes
them: stacked experts quantized to Q8_0/Q4_0/Q5_0, the router, Qwen2-MoE's shared expert,
Mixtral's permuted q/k rows. The config must be the model's, the weights exactly what the
``gguf`` library dequantizes, and greedy tokens those of transformers running those weights."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loader.gguf_loader import iter_weights, load_config
from engine.testing.tiny_gguf import gguf_round_trip_state_dict, tiny_vocab, write_tiny_moe_gguf

MOE = {
    "qwen3_moe": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                      norm_topk_prob=True, head_dim=32),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, norm_topk_prob=False),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
}  # fmt: skip


def _tiny_hf(kind: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        kind, vocab_size=len(tiny_vocab()[0]), hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=2, eos_token_id=1, pad_token_id=0, **MOE[kind],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # decisive routing and greedy choices
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif p.dim() >= 2:
                p.normal_(0.0, 1.5 / p.shape[-1] ** 0.5)
            else:
                p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module", params=list(MOE))
def moe_gguf(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    kind = request.param
    hf = _tiny_hf(kind)
    path = write_tiny_moe_gguf(tmp_path_factory.mktemp(kind) / f"{kind}.gguf", hf)
    reference = AutoModelForCausalLM.from_config(hf.config).eval()
    reference.load_state_dict(gguf_round_trip_state_dict(hf))
    return kind, path, reference


def test_config_is_the_models(moe_gguf):
    kind, path, reference = moe_gguf
    ours, theirs = load_config(path), reference.config
    assert ours.architectures == [type(reference).__name__]
    keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "num_experts_per_tok", "vocab_size"]  # fmt: skip
    if kind == "mixtral":
        keys += ["num_local_experts", "intermediate_size"]
    else:
        keys += ["num_experts", "moe_intermediate_size", "norm_topk_prob"]
    if kind == "qwen2_moe":
        keys += ["shared_expert_intermediate_size", "qkv_bias"]
    if kind == "qwen3_moe":
        keys += ["head_dim"]
    for key in keys:
        assert getattr(ours, key) == getattr(theirs, key), key


def test_weights_are_the_gguf_librarys_dequantization(moe_gguf):
    """Stacked experts come out as ``<block>.experts.{gate,up,down}_proj`` (every expert at
    once), bit-equal to the gguf library's dequantization; the rest under HF names."""
    kind, path, reference = moe_gguf
    expected = reference.state_dict()
    block = "block_sparse_moe" if kind == "mixtral" else "mlp"
    seen = set()
    for name, tensor in iter_weights(path, load_config(path), torch.float32):
        stacked = name.rsplit(".", 2)
        if ".experts." in name:
            layer = name.split(".")[2]
            assert name.startswith(f"model.layers.{layer}.{block}.experts."), name
            gate_up = expected[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
            want = {
                "gate_proj": gate_up.chunk(2, dim=1)[0],
                "up_proj": gate_up.chunk(2, dim=1)[1],
                "down_proj": expected[f"model.layers.{layer}.mlp.experts.down_proj"],
            }[stacked[-2]]
        else:
            want = expected[name.replace(f".{block}.", ".mlp.")]
        assert torch.equal(tensor, want), name
        seen.add(name)
    # Every HF tensor, the fused gate_up_proj of each layer as two (gate, up).
    assert len(seen) == len(expected) + reference.config.num_hidden_layers


def test_greedy_tokens_equal_transformers_on_the_same_weights(
    moe_gguf, tmp_path, monkeypatch, torch_cpu_kernels
):
    """Token for token, so through the exact torch kernels: the compiled CPU ones quantize
    activations to int8 (tests/test_cpu_gguf_avx2.py holds them to that)."""
    kind, path, reference = moe_gguf
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    rng = random.Random(1)
    vocab = reference.config.vocab_size
    prompts = [[rng.randrange(6, vocab) for _ in range(n)] for n in (1, 5, 19, 40)]
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=16,
              num_gpu_blocks_override=96)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        ids, expected = torch.tensor([prompt]), []
        with torch.no_grad():
            for _ in range(8):
                expected.append(int(reference(ids).logits[0, -1].argmax()))
                ids = torch.cat([ids, torch.tensor([[expected[-1]]])], dim=1)
        assert out.outputs[0].token_ids == expected, f"{kind}: prompt of {len(prompt)}"
    assert llm.llm_engine.num_used_blocks == 0
