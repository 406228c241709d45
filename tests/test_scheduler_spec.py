"""Scheduler with speculative decoding, device-free: draft slots reserved and rolled back,
acceptance counted, only accepted blocks hashed, drafts clamped and dropped where they cannot
pay, and (in the KV-content simulation) outputs identical to plain decoding whatever the
drafts, with preemption, prefix caching, chunked prefill and sliding windows."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, ConfigError, SchedulerConfig, SpeculativeConfig
from engine.kv_cache_manager import KVCacheGroupSpec
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.testing.scheduler_sim import SimRequest, check_invariants, run_simulation


def ngram(k=4, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=k, **kw)


def draft_model(k=4, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=k, **kw)


def make(spec, num_blocks=64, block_size=4, max_tokens=32, max_seqs=8, caching=True,
         max_model_len=128, groups=None, async_scheduling=False) -> Scheduler:  # fmt: skip
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max_tokens,
            async_scheduling=async_scheduling,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        max_model_len,
        num_blocks,
        groups or [KVCacheGroupSpec()],
        speculative_config=spec,
    )


def start(s: Scheduler, rid: str, prompt: list[int], max_tokens=20) -> Request:
    """Add a request and run its prefill (first token 100), alone."""
    return prefill(s, Request(rid, prompt, max_tokens))[0]


def prefill(s: Scheduler, *requests: Request) -> tuple[Request, ...]:
    """Add requests and run their prefills together (first token 100 each)."""
    for request in requests:
        s.add_request(request)
    out = s.schedule()
    assert {e.request.request_id for e in out.scheduled} == {r.request_id for r in requests}
    s.update_from_output(out, {e.request.request_id: [100] for e in out.scheduled if e.samples})
    return requests


def test_drafts_are_verified_in_one_step_after_plain_decodes():
    s = make(ngram(k=3))
    a, b = prefill(s, Request("a", [1, 2, 3], 20), Request("b", [5, 6, 7, 8, 9], 20))
    s.update_draft_token_ids({"b": [11, 12, 13]})
    s.add_request(Request("c", list(range(20, 26)), 4))
    out = s.schedule()
    plan = [
        (e.request.request_id, e.start, e.num_new_tokens, list(e.spec_token_ids))
        for e in out.scheduled
    ]
    # Plain decodes first, then verifications, then prefills (the attention backends'
    # decode path takes the leading one-token entries).
    assert plan == [("a", 3, 1, []), ("b", 5, 4, [11, 12, 13]), ("c", 0, 6, [])]
    assert out.num_batched_tokens == 11
    assert b.spec_token_ids == []  # consumed
    # c may produce 4 tokens: after this step's first, the next step verifies at most 2.
    assert [e.num_to_propose for e in out.scheduled] == [3, 3, 2]
    # b's tables cover its 5 tokens + the 1 + 3 verified ones (9 tokens, 3 blocks).
    assert len(s.kv.block_tables("b")[0]) == 3
    # Two drafts accepted, then the target's own token: 3 tokens, 8 computed.
    s.update_from_output(out, {"a": [40], "b": [11, 12, 77], "c": [50]})
    assert b.output_token_ids == [100, 11, 12, 77]
    assert b.num_computed_tokens == 8 and b.num_tokens == 9
    assert a.num_computed_tokens == 4
    check_invariants(s)
    stats = s.stats().spec_decoding
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0]
    assert stats.mean_acceptance_length == 3.0


def test_rejected_slots_are_rolled_back_and_never_hashed():
    s = make(ngram(k=4), block_size=4)
    r = start(s, "r", [1, 2, 3])  # 3 prompt tokens + 1 output: block 0 holds positions 0-3
    s.update_draft_token_ids({"r": [7, 7, 7, 7]})
    used = s.num_used_blocks
    out = s.schedule()
    assert out.scheduled[0].num_new_tokens == 5  # positions 3..7: two blocks
    assert s.num_used_blocks == used + 1
    tail = s.kv.block_tables("r")[0][1]
    s.update_from_output(out, {"r": [9]})  # every draft rejected
    assert r.num_computed_tokens == 4 and r.output_token_ids == [100, 9]
    # The block that held only rejected drafts went back, unhashed; block 0 (accepted
    # tokens only) is cached.
    assert s.num_used_blocks == used
    assert s.kv.pool.is_free(tail) and s.kv.pool.block_hash[tail] is None
    first = s.kv.block_tables("r")[0][0]
    assert s.kv.pool.block_hash[first] is not None
    check_invariants(s)
    s.finish_request("r", RequestStatus.FINISHED_ABORTED)
    assert s.num_used_blocks == 0


def test_drafts_are_clamped_to_budget_and_max_tokens():
    s = make(ngram(k=4), max_tokens=4)
    r = start(s, "r", [1, 2, 3], max_tokens=5)
    s.update_draft_token_ids({"r": [1, 2, 3, 4]})
    out = s.schedule()
    # 1 output so far: 4 more allowed, the target's own token among them -> 3 drafts, and
    # the 4-token budget allows 1 + 3.
    assert list(out.scheduled[0].spec_token_ids) == [1, 2, 3]
    # After this step at least 2 outputs: the next may verify at most 5 - 2 - 1 = 2.
    assert out.scheduled[0].num_to_propose == 2
    s.update_from_output(out, {"r": [1, 2, 3, 4]})
    assert r.num_output_tokens == 5 == r.max_tokens
    s2 = make(ngram(k=4), max_tokens=3)
    start(s2, "q", [1, 2, 3])
    s2.update_draft_token_ids({"q": [1, 2, 3, 4]})
    assert list(s2.schedule().scheduled[0].spec_token_ids) == [1, 2]


def test_no_speculation_above_disable_by_batch_size():
    s = make(ngram(k=2, disable_by_batch_size=2))
    prefill(s, *(Request(rid, [1, 2, 3], 20) for rid in "abc"))
    s.update_draft_token_ids({"a": [4, 5]})
    out = s.schedule()
    assert all(not e.spec_token_ids and e.num_to_propose == 0 for e in out.scheduled)
    assert s.get_request("a").spec_token_ids == []  # stale drafts are dropped
    s.update_from_output(out, {e.request.request_id: [1] for e in out.scheduled})
    s.finish_request("c", RequestStatus.FINISHED_STOPPED)
    s.update_draft_token_ids({"a": [4, 5]})
    out = s.schedule()
    assert [len(e.spec_token_ids) for e in out.scheduled] == [0, 2]  # plain decode first
    assert all(e.num_to_propose == 2 for e in out.scheduled)


def test_default_disable_by_batch_size_follows_the_token_budget():
    assert ngram(k=4).disable_by_batch_size == 51  # 256 // 5
    assert ngram(k=1).disable_by_batch_size == 128


def test_proposer_lookahead_slots_are_reserved_then_returned():
    s = make(draft_model(k=3), block_size=4)
    r = start(s, "r", [1, 2, 3])
    s.update_draft_token_ids({"r": [5, 6, 7]})
    out = s.schedule()
    entry = out.scheduled[0]
    assert entry.num_new_tokens == 4 and entry.num_to_propose == 3
    # Positions 3..6 verified and up to 3 more the draft model writes: 10 slots, 3 blocks.
    assert len(entry.block_ids[0]) == 3
    s.update_from_output(out, {"r": [5, 6, 7, 8]})
    assert r.num_computed_tokens == 7
    assert len(s.kv.block_tables("r")[0]) == 2
    check_invariants(s)


def test_preemption_drops_drafts_and_the_request_resumes():
    s = make(ngram(k=4), num_blocks=5, block_size=4, max_tokens=16)
    # 8 tokens each after the prefill: 2 blocks each, all 4 usable blocks held.
    a, b = prefill(s, Request("a", list(range(1, 8)), 8), Request("b", list(range(20, 27)), 8))
    s.update_draft_token_ids({"a": [1, 2, 3, 4], "b": [1, 2, 3, 4]})
    out = s.schedule()  # a needs 2 more blocks for 5 tokens; only 0 free: b is preempted
    assert "b" in out.preempted_ids
    assert b.spec_token_ids == [] and b.status is RequestStatus.PREEMPTED
    s.update_from_output(out, {"a": [9]})
    check_invariants(s)
    assert a.num_computed_tokens == 8


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_async_mode_accounts_verifications_when_they_complete(async_scheduling):
    s = make(ngram(k=2), async_scheduling=async_scheduling)
    a = Request("a", [1, 2, 3], 10)
    s.add_request(a)
    out = s.schedule()
    s.update_from_output(out, {"a": [4]})
    s.update_draft_token_ids({"a": [5, 6]})
    out = s.schedule()
    # Not advanced when scheduled, even in asynchronous mode: no placeholder.
    assert a.num_computed_tokens == 3 and a.output_token_ids == [4]
    s.update_from_output(out, {"a": [5, 8]})
    assert a.num_computed_tokens == 5 and a.output_token_ids == [4, 5, 8]
    check_invariants(s)


def test_speculative_config_validation():
    with pytest.raises(ConfigError, match="num_speculative_tokens is required"):
        SpeculativeConfig(method="ngram")
    with pytest.raises(ConfigError, match="choose one of ngram, draft_model, eagle, eagle3"):
        SpeculativeConfig(method="medusa", num_speculative_tokens=2)
    with pytest.raises(ConfigError, match="prompt_lookup_min=4 must be <= prompt_lookup_max=2"):
        ngram(prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ConfigError, match="needs a model"):
        SpeculativeConfig(method="eagle", num_speculative_tokens=2)
    with pytest.raises(ConfigError, match="unknown key.*speculative_tokens.*known: method"):
        SpeculativeConfig.from_dict({"method": "ngram", "speculative_tokens": 2})
    with pytest.raises(ConfigError, match="not valid JSON"):
        SpeculativeConfig.from_dict("{method: ngram}")
    # vLLM's defaults and inference of the method.
    cfg = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)
    assert ngram(prompt_lookup_max=3).prompt_lookup_min == 3
    assert SpeculativeConfig(model="ngram", num_speculative_tokens=2).method == "ngram"
    assert SpeculativeConfig(model="x/EAGLE3-8B", num_speculative_tokens=2).method == "eagle3"
    assert SpeculativeConfig(model="x/EAGLE-8B", num_speculative_tokens=2).method == "eagle"
    assert SpeculativeConfig(model="x/tiny", num_speculative_tokens=2).method == "draft_model"
    assert ngram().num_lookahead_slots == 0 and draft_model(k=3).num_lookahead_slots == 3


def _sim_requests() -> list[SimRequest]:
    reqs = []
    for i in range(14):
        base = [(7 * i + j) % 23 for j in range(3 + i % 5)]
        prompt = (base * 5)[: 2 + (i * 11) % 40]
        if i % 4 == 0:
            prompt = [1, 2, 3, 4, 5, 6, 7, 8] + prompt  # shared prefix: cache hits
        reqs.append(SimRequest(f"r{i}", prompt, 6 + (i * 5) % 19, arrival_step=i % 6))
    return reqs


@pytest.mark.parametrize(
    ("spec", "groups", "accuracy"),
    [
        (ngram(k=4), None, 0.8),
        (ngram(k=2), None, 0.3),
        (draft_model(k=3), None, 0.7),
        (ngram(k=3), [KVCacheGroupSpec(), KVCacheGroupSpec(sliding_window=6)], 0.7),
        (ngram(k=5, disable_by_batch_size=3), None, 1.0),
    ],
    ids=["ngram-k4", "ngram-k2-rejecting", "lookahead", "sliding", "batch-limit"],
)
def test_simulated_outputs_equal_plain_decoding(spec, groups, accuracy):
    """The KV-content simulation: whatever the drafts, a speculative run produces the plain
    run's tokens (greedy verification against what the fake model reads back from the KV),
    with preemption (a small cache), prefix hits and chunked prefill; no block leaks."""
    plain = run_simulation(make(None, num_blocks=24, max_tokens=16, groups=groups), _sim_requests())
    s = make(spec, num_blocks=24, max_tokens=16, groups=groups)
    got = run_simulation(s, _sim_requests(), draft_accuracy=accuracy, seed=3)
    assert got.outputs == plain.outputs
    stats = s.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    sd = stats.spec_decoding
    assert sd.num_drafts > 0 and 0 < sd.num_accepted_tokens <= sd.num_draft_tokens
    assert got.num_steps < plain.num_steps or accuracy < 0.5
