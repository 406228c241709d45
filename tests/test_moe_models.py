"""Mixtral, Qwen2-MoE and Qwen3-MoE end to end through the offline ``LLM`` on the CPU: greedy
tokens identical to transformers on tiny random checkpoints (many experts, top-2 / top-4 /
top-8, a shared expert, dense layers among sparse ones), for a batch of mixed-length prompts
run with chunked prefill, prefix caching and preemption; and the expert-load counters.

(``tests/test_models_vs_hf.py`` checks the same models' logits at every position.)
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing.tiny_models import build_tiny_model

ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]
NUM_NEW = 12


@pytest.fixture(scope="module", params=ARCHS)
def moe_model(request, tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), request.param, num_layers=3)
    return request.param, path


def hf_greedy(model, prompt: list[int], num_new: int) -> list[int]:
    ids, past, tokens = torch.tensor([prompt]), None, []
    with torch.no_grad():
        for _ in range(num_new):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return tokens


def test_greedy_matches_transformers(moe_model):
    from transformers import AutoModelForCausalLM

    arch, path = moe_model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(0)
    vocab = hf.config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in (1, 3, 8, 17, 33, 64, 90)]
    prompts.append(prompts[5][:40] + [rng.randrange(10, vocab) for _ in range(7)])  # shared prefix
    llm = LLM(
        model=str(path),
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=32,  # chunked prefill
        max_num_seqs=6,
        num_gpu_blocks_override=48,  # small enough to preempt
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NUM_NEW), (
            f"{arch}: prompt of {len(prompt)} tokens"
        )
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert llm.llm_engine.num_used_blocks == 0


def test_expert_load_counts_every_routed_token(moe_model):
    from engine.layers.fused_moe import enable_expert_load_counting, read_expert_load

    arch, path = moe_model
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_gpu_blocks_override=64)
    model = llm.llm_engine.runner.model
    layers = enable_expert_load_counting(model)
    spec = type(model).moe_spec(model.config)
    assert layers == sum(spec.is_sparse(i) for i in range(model.config.num_hidden_layers)) > 0
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(10, 20))}], params, use_tqdm=False)
    counts = read_expert_load(model)
    # 10 prompt tokens and 4 fed-back samples went through every sparse layer, top_k each.
    assert counts.shape == (layers, spec.num_experts)
    assert counts.sum(dim=1).tolist() == [14 * spec.top_k] * layers


def test_throughput_benchmark_reports_expert_load(moe_model, tmp_path, capsys):
    """``engine bench throughput --expert-load``: the step profile counts every routed token
    of the timed run (4 prompts of 16 tokens, 3 fed-back samples each)."""
    import json

    from engine.benchmarks import throughput

    arch, path = moe_model
    out = tmp_path / "result.json"
    argv = ["--model", str(path), "--dtype", "float32", "--num-prompts", "4", "--input-len", "16",
            "--output-len", "4", "--no-warmup", "--expert-load", "--json", str(out)]  # fmt: skip
    assert throughput.main(argv) == 0
    load = json.loads(out.read_text())["step_split"]["expert_load"]
    from transformers import AutoConfig

    from engine.models.registry import ModelRegistry

    config = AutoConfig.from_pretrained(path)
    spec = ModelRegistry().resolve(config.architectures)[1].moe_spec(config)
    layers = sum(spec.is_sparse(i) for i in range(config.num_hidden_layers))
    assert load["layers"] == layers
    assert load["routed_tokens"] == (4 * 16 + 4 * 3) * spec.top_k * layers
    assert all(len(layer["tokens_per_expert"]) == spec.num_experts for layer in load["per_layer"])
    assert "Expert load over" in capsys.readouterr().out
