"""Asynchronous scheduling (one step in flight, tokens fed back on the device), forced on
for the CPU so its bookkeeping is tested where CI runs: the tokens must be exactly those of
transformers and of the synchronous engine, and nothing may leak when requests stop, are
preempted or aborted while a step is in flight."""

from __future__ import annotations

import pytest
import torch
from test_llm_vs_hf import hf_greedy, make_prompts

from engine import LLM, SamplingParams
from engine.request import PLACEHOLDER_TOKEN
from engine.testing.tiny_models import build_tiny_model

NUM_NEW = 24


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama_async"), "llama")


def make_llm(path, async_scheduling: bool, **kw) -> LLM:
    settings = dict(
        model=str(path),
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        num_gpu_blocks_override=160,
        enable_prefix_caching=True,
        async_scheduling=async_scheduling,
    )
    settings.update(kw)
    return LLM(**settings)


@pytest.fixture(scope="module")
def async_llm(llama_path):
    return make_llm(llama_path, True)


@pytest.fixture(scope="module")
def sync_llm(llama_path):
    return make_llm(llama_path, False)


def test_greedy_matches_transformers_with_preemption_and_prefix_hits(llama_path, async_llm):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    engine = async_llm.llm_engine
    assert engine.core._async and engine.scheduler.async_output
    prompts = make_prompts(hf.config.vocab_size)
    # Different lengths, so requests finish (and free blocks) while a step is in flight.
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + i % 17, ignore_eos=True)
        for i in range(len(prompts))
    ]
    before = engine.get_stats()
    outputs = async_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outputs, strict=True):
        want, _ = hf_greedy(hf, prompt, p.max_tokens)
        assert out.outputs[0].token_ids == want, f"prompt of {len(prompt)} tokens"
        assert out.outputs[0].finish_reason == "length"
    stats = engine.get_stats()
    assert stats.num_preemptions > before.num_preemptions, "the small cache must preempt"
    assert stats.prefix_cache_hits > before.prefix_cache_hits
    assert engine.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_steps_really_overlap(async_llm):
    """After a decode step of plain requests a step is left in flight, and the next step's
    inputs include tokens the host has not seen yet (placeholders)."""
    engine = async_llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", None, params, prompt_token_ids=[11, 12, 13])
    engine.add_request("b", None, params, prompt_token_ids=[21, 22, 23, 24, 25])
    engine.step()
    assert len(engine.core._in_flight) == 1
    engine.step()
    request = engine.scheduler.get_request("a")
    assert request.output_token_ids[-1] == PLACEHOLDER_TOKEN
    assert request.num_output_placeholders == 1
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert {len(t) for t in finished.values()} == {6}
    assert all(PLACEHOLDER_TOKEN not in t for t in finished.values())
    assert engine.num_used_blocks == 0


def mixed_requests(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = make_prompts(vocab, seed=3)[:12]
    params = [
        SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=NUM_NEW, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=6, max_tokens=11, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=NUM_NEW, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=3),
        SamplingParams(n=2, temperature=0.9, seed=8, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=9, max_tokens=NUM_NEW, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True),
    ]
    return prompts, params


def test_mixed_sampling_equals_synchronous_engine(async_llm, sync_llm):
    """Seeded sampling, penalties, logprobs, n > 1 and min_tokens (the last four run their
    steps synchronously) give the same results with and without asynchronous scheduling."""
    prompts, params = mixed_requests(async_llm.llm_engine.runner.vocab_size)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    got = async_llm.generate(inputs, params, use_tqdm=False)
    want = sync_llm.generate(inputs, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs]
        assert [c.text for c in g.outputs] == [c.text for c in w.outputs]
        if w.outputs[0].logprobs is not None:
            assert g.outputs[0].logprobs == w.outputs[0].logprobs
        assert (g.prompt_logprobs is None) == (w.prompt_logprobs is None)
    for llm in (async_llm, sync_llm):
        assert llm.llm_engine.num_used_blocks == 0


def test_stop_token_found_late_discards_the_step_in_flight(async_llm, sync_llm):
    """A stop token is seen only after the next step was launched; the extra token is
    dropped, and streaming outputs never show a placeholder."""
    prompt = [31, 32, 33, 34, 35, 36]
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    base = sync_llm.generate({"prompt_token_ids": prompt}, free, use_tqdm=False)[0]
    stop_id = base.outputs[0].token_ids[4]
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id])
    want = sync_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]

    engine = async_llm.llm_engine
    engine.add_request("s", None, params, prompt_token_ids=prompt)
    streamed: list[int] = []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.new_token_ids[0]
            if out.finished:
                final = out.outputs[0]
    assert final.token_ids == want.token_ids == streamed
    assert final.finish_reason == "stop" and final.stop_reason == stop_id
    assert engine.num_used_blocks == 0


def test_abort_while_a_step_is_in_flight(async_llm):
    engine = async_llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"x{i}", None, params, prompt_token_ids=[40 + i] * (5 + i))
    for _ in range(3):
        engine.step()
    assert len(engine.core._in_flight) == 1
    engine.abort_request(["x1", "x2"])
    seen = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.add(out.request_id)
            assert out.request_id not in ("x1", "x2")
    assert seen == {"x0", "x3"}
    assert engine.num_used_blocks == 0
