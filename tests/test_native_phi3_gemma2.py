"""The native Phi-3 (partial rotary, fused checkpoint tensors, LongRoPE), Gemma 2 (attention and
final logit soft-capping, alternating sliding window) and Mistral-with-sliding-window paths
through the offline ``LLM`` on the CPU: greedy tokens equal transformers' own decoding on tiny
random checkpoints, for mixed-length batches with chunked prefill, prefix caching and
preemption, with prompts longer than the sliding windows.

(``tests/test_models_vs_hf.py`` checks the same models' logits at every position.)
"""

from __future__ import annotations

import random

import pytest
import torch
from greedy_reference import assert_greedy_matches, hf_greedy, mixed_prompts

from engine import LLM, SamplingParams
from engine.testing.tiny_models import build_tiny_model

NUM_NEW = 10
LENGTHS = (1, 3, 8, 17, 33, 64, 90)  # the windows below are 6 and 8 tokens


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _llm(path, num_blocks: int = 40, **kw) -> LLM:
    settings = dict(
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=6,
        num_gpu_blocks_override=num_blocks,
    )
    settings.update(kw)
    return LLM(model=str(path), **settings)


@pytest.mark.parametrize(
    ("arch", "native_class", "overrides"),
    [
        # Phi-4-mini's partial rotary; q/k/v and gate/up stored fused in the checkpoint.
        ("phi3", "Phi3ForCausalLM", {}),
        # Phi-3-mini-4k-style window on every layer.
        ("phi3", "Phi3ForCausalLM", {"sliding_window": 6}),
        ("gemma2", "Gemma2ForCausalLM", {}),
        ("mistral", "LlamaForCausalLM", {"sliding_window": 6}),
    ],
    ids=["phi3", "phi3-window", "gemma2", "mistral-window"],
)
def test_greedy_matches_transformers(arch, native_class, overrides, tmp_path):
    path = build_tiny_model(tmp_path, arch, **overrides)
    hf = _hf(path)
    # Few enough KV blocks that the batch preempts (a window on every layer needs far fewer).
    llm = _llm(path, num_blocks=16 if overrides.get("sliding_window") else 40)
    model = llm.llm_engine.runner.model
    assert type(model).__name__ == native_class and llm.config.model.implementation == "native"
    window = overrides.get("sliding_window") or getattr(hf.config, "sliding_window", None)
    layers = model.attention_layers()
    if arch == "gemma2":
        assert [a.sliding_window for a in layers] == [8, None]
        assert [a.logit_softcap for a in layers] == [10.0, 10.0]
        assert model.lm_head.final_logit_softcap == 8.0
    elif window:
        assert [a.sliding_window for a in layers] == [window] * len(layers)
    prompts = mixed_prompts(hf.config.vocab_size, LENGTHS)
    assert_greedy_matches(llm, hf, prompts, NUM_NEW)
    assert llm.llm_engine.get_stats().num_preemptions > 0


# ---- LongRoPE ---------------------------------------------------------------------------------
ORIGINAL = 64  # original_max_position_embeddings; max_position_embeddings 256 (factor 4)


def _longrope_model(tmp_path):
    rng = random.Random(3)
    half = int(16 * 0.75) // 2  # head_dim 16, Phi-4-mini's partial_rotary_factor
    rope = {
        "type": "longrope",  # as Phi-3 config.json files spell it
        "short_factor": [round(rng.uniform(1.0, 1.3), 3) for _ in range(half)],
        "long_factor": [round(rng.uniform(1.0, 12.0), 3) for _ in range(half)],
    }
    return build_tiny_model(
        tmp_path,
        "phi3",
        rope_scaling=rope,
        max_position_embeddings=4 * ORIGINAL,
        original_max_position_embeddings=ORIGINAL,
    )


def test_longrope_picks_short_or_long_factors_per_request(tmp_path):
    """Requests within the original context use the short factors, longer ones the long
    factors, decided for each request of the batch on its own, as transformers decides per
    sequence: prompts below 64 tokens, one that crosses 64 while decoding and prompts beyond it
    (prefilled in one step, as transformers does) all match in one batch."""
    path = _longrope_model(tmp_path)
    hf = _hf(path)
    llm = _llm(path, num_blocks=128, max_num_batched_tokens=512)
    rotary = llm.llm_engine.runner.model.model.layers[0].self_attn.rotary_emb
    assert type(rotary).__name__ == "LongRopeRotaryEmbedding" and rotary.rot_dim == 12
    rng = random.Random(0)
    vocab = hf.config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in (5, 40, 60, 65, 100, 150)]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NUM_NEW), len(prompt)
    assert llm.llm_engine.num_used_blocks == 0


def test_longrope_rows_follow_each_requests_context():
    """``rope_positions``: the long table (offset by max_position) for the tokens of requests
    whose context after the step exceeds the original length, the short table otherwise."""
    from engine.kernels import KernelRegistry
    from engine.layers.rotary import LongRopeRotaryEmbedding

    params = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 4,
        "long_factor": [4.0] * 4,
        "original_max_position_embeddings": 8,
        "max_position_embeddings": 32,
    }
    rope = LongRopeRotaryEmbedding(8, 32, params, KernelRegistry().resolve("cpu"))
    assert rope.cos_sin_cache.shape == (64, 8)
    # A decode at position 8 (context 9 > 8), a decode at 3, a 3-token chunk ending at 7 and a
    # 2-token chunk at 9..10.
    positions = torch.tensor([8, 3, 5, 6, 7, 9, 10])
    qsl = torch.tensor([0, 1, 2, 5, 7], dtype=torch.int32)
    seq_lens = torch.tensor([9, 4, 8, 11], dtype=torch.int32)
    rows = rope.rope_positions(positions, qsl, seq_lens)
    assert rows.tolist() == [40, 3, 5, 6, 7, 41, 42]
    # The short table's attention factor: sqrt(1 + ln(32 / 8) / ln(8)).
    expected = (1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(8.0))) ** 0.5
    torch.testing.assert_close(rope.cos_sin_cache[0, :4], expected.repeat(4))
