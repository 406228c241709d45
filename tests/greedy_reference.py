"""Greedy tokens through the offline ``LLM`` against transformers' own incremental decoding, for
the model tests of tests/test_transformers_backend.py and tests/test_native_phi3_gemma2.py."""

from __future__ import annotations

import random
from typing import Any

import torch


def hf_greedy(model: Any, prompt: list[int], num_new: int) -> list[int]:
    """transformers' forward with its own KV cache, one token at a time, argmax."""
    ids, past, tokens = torch.tensor([prompt]), None, []
    with torch.no_grad():
        for _ in range(num_new):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return tokens


def mixed_prompts(vocab: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    """Random prompts of ``lengths``, plus one sharing the first 40 tokens of the longest (so
    the prefix cache is hit)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]
    longest = max(prompts, key=len)
    prompts.append(longest[:40] + [rng.randrange(10, vocab) for _ in range(7)])
    return prompts


def assert_greedy_matches(llm: Any, hf: Any, prompts: list[list[int]], num_new: int) -> None:
    """Every prompt's greedy tokens through ``llm`` (all submitted together) equal ``hf``'s,
    the prefix cache was hit, and no KV block is left in use."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        want = hf_greedy(hf, prompt, num_new)
        assert out.outputs[0].token_ids == want, f"prompt of {len(prompt)} tokens"
    assert llm.llm_engine.get_stats().prefix_cache_hits > 0
    assert llm.llm_engine.num_used_blocks == 0
