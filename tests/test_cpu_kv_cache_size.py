"""The CPU KV cache takes min(``cpu_kv_cache_gb``, what ``max_num_seqs`` max-length requests
can use + the null block), through the real ``LLM`` on a tiny model.

``torch.zeros`` makes every byte of the cache resident, so a 4 GiB default budget for a model
whose requests can never hold more than a few MiB would be RAM held for nothing. The tests check
the block count the rule gives, the bytes actually allocated, the log line, that the budget
still caps the cache, that a cache sized exactly by the rule serves ``max_num_seqs`` max-length
requests at once with no preemption (also with asynchronous scheduling), and exact tokens
against transformers.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.testing.tiny_models import build_tiny_model

MAX_MODEL_LEN = 64
MAX_NUM_SEQS = 3
BLOCK_SIZE = 4
PER_REQUEST = MAX_MODEL_LEN // BLOCK_SIZE  # one full-attention group
# 2 layers x (k, v) x block_size x 2 KV heads x head_dim 16 x float32
BYTES_PER_BLOCK = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path_factory.mktemp("llama-kv"), "llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def make_llm(path, **kw) -> LLM:
    args = dict(
        model=str(path),
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )
    return LLM(**{**args, **kw})


def cache_bytes(llm: LLM) -> int:
    return sum(t.numel() * t.element_size() for t in llm.llm_engine.runner.kv_caches)


def prompts_and_lengths(vocab: int) -> list[tuple[list[int], int]]:
    """(prompt, new tokens): five requests, three of them exactly max_model_len long."""
    rng = random.Random(1)
    shapes = [(40, 24), (1, 63), (50, 14), (7, 20), (30, 10)]
    return [([rng.randrange(10, vocab) for _ in range(p)], n) for p, n in shapes]


def hf_greedy(hf, prompt: list[int], num_new: int) -> list[int]:
    """transformers' greedy tokens, one full forward per token (EOS allowed, as with
    ``ignore_eos``: ``generate(min_new_tokens=...)`` would forbid it)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_new):
            ids.append(int(hf(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def check_tokens(llm: LLM, hf) -> None:
    cases = prompts_and_lengths(hf.config.vocab_size)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in cases]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in cases], params, use_tqdm=False)
    for (prompt, n), out in zip(cases, outs, strict=True):
        want = hf_greedy(hf, prompt, n)
        assert out.outputs[0].token_ids == want, f"prompt of {len(prompt)} tokens"
    assert llm.llm_engine.num_used_blocks == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_cache_sized_by_what_requests_can_use(model, caplog, async_scheduling):
    path, hf = model
    with caplog.at_level(logging.INFO, logger="engine.model_runner"):
        llm = make_llm(path, async_scheduling=async_scheduling)  # default budget: 4 GiB
    runner = llm.llm_engine.runner
    assert runner.bytes_per_block() == BYTES_PER_BLOCK
    want_blocks = MAX_NUM_SEQS * PER_REQUEST + 1
    assert runner.num_blocks == want_blocks
    assert cache_bytes(llm) == want_blocks * BYTES_PER_BLOCK  # 98 KiB, not 4 GiB
    assert any(
        f"CPU KV cache: {want_blocks} blocks" in r.getMessage()
        and "within the default 4 GiB budget" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]

    # The rule is enough: max_num_seqs max-length requests run together, never preempted.
    check_tokens(llm, hf)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions == 0


def test_budget_still_caps_the_cache(model, caplog):
    path, hf = model
    budget_blocks = PER_REQUEST + 4  # one max-length request fits, three do not
    gb = budget_blocks * BYTES_PER_BLOCK / 2**30
    with caplog.at_level(logging.INFO, logger="engine.model_runner"):
        llm = make_llm(path, cpu_kv_cache_gb=gb)
    assert llm.llm_engine.runner.num_blocks == budget_blocks
    assert cache_bytes(llm) == budget_blocks * BYTES_PER_BLOCK
    assert any("capped by the cpu_kv_cache_gb=" in r.getMessage() for r in caplog.records)
    check_tokens(llm, hf)  # still exact, now through preemption
    assert llm.llm_engine.get_stats().num_preemptions > 0


def test_budget_below_one_request_is_a_clear_error(model):
    path, _ = model
    gb = PER_REQUEST * BYTES_PER_BLOCK / 2**30  # one block short (the null block)
    with pytest.raises(ConfigError, match=f"max_model_len={MAX_MODEL_LEN} needs {PER_REQUEST}"):
        make_llm(path, cpu_kv_cache_gb=gb)
    with pytest.raises(ConfigError, match="cpu_kv_cache_gb must be > 0"):
        make_llm(path, cpu_kv_cache_gb=0)
