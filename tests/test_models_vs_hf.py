"""Model-level correctness: our models + loader + runner + reference attention backend against
transformers' forward on the same tiny random checkpoints (float32, atol 1e-4)."""

from __future__ import annotations

import random

import pytest
import torch
from runner_utils import BlockAllocator, make_runner, new_request, schedule
from transformers import AutoModelForCausalLM

from engine.testing.tiny_models import TINY_CONFIGS, save_tiny_model

KINDS = list(TINY_CONFIGS)
ATOL = 1e-4


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    path = save_tiny_model(request.param, tmp_path_factory.mktemp(request.param), seed=1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def random_prompts(lengths, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def test_full_prefill_batch_matches_hf_at_every_position(tiny):
    kind, path, hf = tiny
    runner, _ = make_runner(path)
    groups = runner.kv_cache_groups()
    prompts = random_prompts([1, 7, 12, 3, 20], hf.config.vocab_size)
    reqs = [new_request(f"r{i}", p) for i, p in enumerate(prompts)]
    alloc = BlockAllocator(runner.num_blocks, len(groups))
    sched = schedule([(r, r.num_prompt_tokens) for r in reqs], alloc, runner.block_size)
    batch = runner._prepare(sched.scheduled)
    with torch.inference_mode():
        hidden = runner.model(batch.input_ids, batch.positions, batch.attn_metadata)
        logits = runner.model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    for i, p in enumerate(prompts):
        lo, hi = batch.query_start_loc[i], batch.query_start_loc[i + 1]
        torch.testing.assert_close(logits[lo:hi], hf_logits(hf, p), atol=ATOL, rtol=0)


def test_chunked_prefill_prefix_and_decodes_match_hf(tiny):
    """Chunked prefill over two steps against the cached prefix, mixed with full prefills and
    then decodes batched together; every sampled row's logits equal transformers' and the greedy
    tokens are the same."""
    kind, path, hf = tiny
    runner, sampler = make_runner(path)
    groups = runner.kv_cache_groups()
    alloc = BlockAllocator(runner.num_blocks, len(groups), seed=3)
    prompts = random_prompts([13, 7, 1, 9], hf.config.vocab_size, seed=1)
    a, b, c, d = (new_request(f"r{i}", p) for i, p in enumerate(prompts))

    def step(plan):
        sched = schedule(plan, alloc, runner.block_size)
        rows = {s.request.request_id: object() for s in sched.scheduled if s.samples}
        out = runner.execute(sched, rows)
        logits = sampler.seen[-1] if rows else None
        checked = 0
        for s in sched.scheduled:
            if not s.samples:
                assert s.request.request_id not in out.sampled
                continue
            expected = hf_logits(hf, s.request.all_token_ids)[-1]
            torch.testing.assert_close(logits[checked], expected, atol=ATOL, rtol=0)
            assert out.sampled[s.request.request_id] == [int(expected.argmax())]
            s.request.output_token_ids += out.sampled[s.request.request_id]
            checked += 1
        return out

    step([(c, 1), (a, 5), (b, 7), (d, 4)])  # a and d: first chunks, no sampling
    step([(b, 1), (c, 1), (a, 8), (d, 3)])  # a: rest of prompt; d: middle chunk
    step([(a, 1), (b, 1), (c, 1), (d, 2)])  # d: last chunk
    for _ in range(6):
        step([(a, 1), (b, 1), (c, 1), (d, 1)])
    assert len(a.output_token_ids) == 8 and len(d.output_token_ids) == 7


def test_shared_prefix_and_copy_on_write_match_hf(tiny):
    """A second request reuses the first one's cached full blocks (prefix-cache hit) and gets a
    copy of the partially filled block (copy-on-write) before both continue."""
    kind, path, hf = tiny
    runner, sampler = make_runner(path, block_size=4)
    groups = runner.kv_cache_groups()
    alloc = BlockAllocator(runner.num_blocks, len(groups), seed=5)
    (prefix,) = random_prompts([10], hf.config.vocab_size, seed=2)
    x = new_request("x", prefix)
    sched = schedule([(x, 10)], alloc, 4)
    out = runner.execute(sched, {"x": object()})
    x.output_token_ids += out.sampled["x"]

    y = new_request("y", prefix + [5, 6, 7])
    y.num_computed_tokens = 10  # tokens 0..9 come from x's blocks
    shared = [t[:3] for t in alloc.tables["x"]]
    fresh = [alloc.free.pop() for _ in groups]
    alloc.tables["y"] = [t[:2] + [f] for t, f in zip(shared, fresh, strict=True)]
    copies = [(t[2], f) for t, f in zip(shared, fresh, strict=True)]
    sched = schedule([(x, 1), (y, 3)], alloc, 4, blocks_to_copy=copies)
    runner.execute(sched, {"x": object(), "y": object()})
    logits = sampler.seen[-1]
    torch.testing.assert_close(logits[0], hf_logits(hf, x.all_token_ids)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], hf_logits(hf, y.all_token_ids)[-1], atol=ATOL, rtol=0)


def test_bfloat16_tracks_float32(tmp_path):
    """The same checkpoint run in bfloat16 stays close to transformers' float32 logits."""
    path = save_tiny_model("qwen3", tmp_path, seed=4)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner, _ = make_runner(path, dtype="bfloat16")
    assert runner.kv_caches[0].dtype == torch.bfloat16
    (prompt,) = random_prompts([11], hf.config.vocab_size, seed=3)
    req = new_request("r", prompt)
    alloc = BlockAllocator(runner.num_blocks, 1)
    batch = runner._prepare(schedule([(req, 11)], alloc, runner.block_size).scheduled)
    with torch.inference_mode():
        logits = runner.model.compute_logits(
            runner.model(batch.input_ids, batch.positions, batch.attn_metadata)
        )
    expected = hf_logits(hf, prompt)
    err = (logits - expected).abs().max()
    assert err < 0.05 * expected.abs().max(), err
