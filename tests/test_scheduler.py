"""Scheduler: chunked prefill, decode-first order, budgets, policies, preemption, rejection,
aborts, forks and stats."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache_manager import KVCacheGroupSpec
from engine.request import Request, RequestStatus
from engine.scheduler import RequestRejectedError, Scheduler
from engine.testing.scheduler_sim import SimRequest, check_invariants, run_simulation


def make(
    num_blocks=64,
    block_size=4,
    max_tokens=16,
    max_seqs=8,
    policy="fcfs",
    caching=True,
    chunked=True,
    max_model_len=128,
    groups=None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max_tokens,
            policy=policy,
            enable_chunked_prefill=chunked,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        max_model_len,
        num_blocks,
        groups or [KVCacheGroupSpec()],
    )


def req(rid, n_prompt, max_tokens=4, base=0, **kw) -> Request:
    return Request(rid, [base + i for i in range(n_prompt)], max_tokens, **kw)


def step(s: Scheduler, token=7):
    """One engine step with a constant "model"; finishes requests at max_tokens."""
    out = s.schedule()
    s.update_from_output(out, {e.request.request_id: [token] for e in out.scheduled if e.samples})
    for e in out.scheduled:
        r = e.request
        if s.get_request(r.request_id) is not None and len(r.output_token_ids) >= r.max_tokens:
            s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
    check_invariants(s)
    return out


def plan(out):
    return [(e.request.request_id, e.start, e.num_new_tokens, e.samples) for e in out.scheduled]


def test_long_prompt_is_chunked_and_mixed_with_decodes():
    s = make(max_tokens=8)
    s.add_request(req("short", 3, max_tokens=5, arrival_time=0.0))
    s.add_request(req("long", 20, base=100, arrival_time=1.0))
    assert plan(step(s)) == [("short", 0, 3, True), ("long", 0, 5, False)]
    # Decodes first, then the continuing chunk takes the rest of the budget.
    assert plan(step(s)) == [("short", 3, 1, True), ("long", 5, 7, False)]
    assert plan(step(s)) == [("short", 4, 1, True), ("long", 12, 7, False)]
    out = step(s)
    assert plan(out) == [("short", 5, 1, True), ("long", 19, 1, True)]
    assert [e.is_decode for e in out.scheduled] == [True, False]
    assert out.num_batched_tokens == 2
    assert plan(step(s)) == [("short", 6, 1, True), ("long", 20, 1, True)]
    assert s.get_request("short") is None  # 5 tokens: finished
    while s.has_unfinished():
        step(s)
    assert s.num_free_blocks == s.kv.num_usable_blocks


def test_budget_and_max_num_seqs():
    s = make(max_tokens=5, max_seqs=3)
    for i in range(5):
        s.add_request(req(f"r{i}", 2, base=10 * i, arrival_time=float(i)))
    out = step(s)
    assert plan(out) == [("r0", 0, 2, True), ("r1", 0, 2, True), ("r2", 0, 1, False)]
    out = step(s)
    # max_num_seqs: three running, nobody else admitted.
    assert [e.request.request_id for e in out.scheduled] == ["r0", "r1", "r2"]
    assert len(s.running) == 3 and len(s.waiting) == 2


def test_chunked_prefill_off_runs_prompts_whole():
    s = make(max_tokens=8, chunked=False)
    s.add_request(req("a", 6, arrival_time=0.0))
    s.add_request(req("b", 6, base=50, arrival_time=1.0))
    assert plan(step(s)) == [("a", 0, 6, True)]  # b does not fit in the 2 tokens left
    assert plan(step(s)) == [("a", 6, 1, True), ("b", 0, 6, True)]
    with pytest.raises(RequestRejectedError, match="chunked prefill is off"):
        s.add_request(req("c", 9))


def test_priority_policy_admits_lower_values_first():
    s = make(max_tokens=4, policy="priority")
    s.add_request(req("late-low", 4, priority=5, arrival_time=0.0))
    s.add_request(req("urgent", 4, base=20, priority=-1, arrival_time=1.0))
    s.add_request(req("mid-a", 4, base=40, priority=1, arrival_time=2.0))
    s.add_request(req("mid-b", 4, base=60, priority=1, arrival_time=3.0))
    order = [step(s).scheduled[0].request.request_id for _ in range(2)]
    assert order == ["urgent", "urgent"]  # prefill, then its decodes come first
    s2 = make(max_tokens=4, policy="priority", max_seqs=1)
    for r in (
        req("low", 2, priority=5, arrival_time=0.0),
        req("b", 2, base=20, priority=1, arrival_time=2.0),
        req("a", 2, base=40, priority=1, arrival_time=1.0),
    ):
        s2.add_request(r)
    finished = []
    while s2.has_unfinished():
        ids = {e.request.request_id for e in step(s2).scheduled}
        finished += [i for i in ids if s2.get_request(i) is None]
    assert finished == ["a", "b", "low"]


def test_fcfs_ignores_priority():
    s = make(max_tokens=2, max_seqs=1)
    s.add_request(req("first", 2, priority=9, arrival_time=0.0))
    s.add_request(req("second", 2, base=20, priority=0, arrival_time=1.0))
    assert step(s).scheduled[0].request.request_id == "first"


def test_preemption_by_recompute_victim_and_resume():
    # 4 usable blocks of 4 tokens. Two requests of 6-token prompts grow until one must go.
    s = make(num_blocks=5, max_tokens=16, caching=False)
    a = req("a", 6, max_tokens=8, arrival_time=0.0)
    b = req("b", 6, max_tokens=8, base=30, arrival_time=1.0)
    s.add_request(a)
    s.add_request(b)
    step(s)  # both prefilled: 2 blocks each, 7 tokens known
    out = step(s)  # positions 6: fits in block 1
    assert out.preempted_ids == []
    out = step(s)  # position 7 still fits; position 8 needs a third block each
    out = step(s)
    # a (earlier) needs block 2: b (latest arrival) is preempted and a gets b's blocks.
    assert out.preempted_ids == ["b"]
    assert plan(out) == [("a", 8, 1, True)]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and len(b.output_token_ids) == 3  # outputs kept
    assert s.stats().num_preemptions == 1
    assert s.waiting.peek() is b
    while s.get_request("a") is not None:
        step(s)
    # b resumes by recomputing prompt + outputs, then decodes on.
    out = step(s)
    assert plan(out)[0][:3] == ("b", 0, 9)
    while s.has_unfinished():
        step(s)
    assert b.output_token_ids == [7] * 8


def test_preemption_picks_lowest_priority_even_if_already_scheduled():
    s = make(num_blocks=4, max_tokens=16, policy="priority", caching=False)
    hi = req("hi", 4, max_tokens=8, priority=0, arrival_time=1.0)
    lo = req("lo", 3, max_tokens=8, base=50, priority=3, arrival_time=0.0)
    s.add_request(lo)
    s.add_request(hi)
    step(s)
    assert s.num_free_blocks == 1
    step(s)  # hi takes a 2nd block for position 4, lo writes 3 in its block
    out = step(s)  # lo needs a block at position 4 and none is left: lo preempts itself
    assert out.preempted_ids == ["lo"] and plan(out) == [("hi", 5, 1, True)]
    s3 = make(num_blocks=4, max_tokens=16, policy="priority", caching=False)
    lo = req("lo", 4, max_tokens=8, base=50, priority=3, arrival_time=0.0)
    hi = req("hi", 3, max_tokens=8, priority=0, arrival_time=1.0)
    s3.add_request(lo)
    s3.add_request(hi)
    step(s3)
    step(s3)
    out = step(s3)
    # hi (scheduled after lo, which already took a block this step) needs a block:
    # lo is the victim, its entry and budget are withdrawn.
    assert out.preempted_ids == ["lo"]
    assert plan(out) == [("hi", 4, 1, True)]
    assert out.num_batched_tokens == 1


def test_no_admission_in_a_step_that_preempted():
    s = make(num_blocks=9, max_tokens=16, caching=False)
    s.add_request(req("a", 8, max_tokens=20, arrival_time=0.0))
    s.add_request(req("b", 4, max_tokens=20, base=30, arrival_time=1.0))
    step(s)
    s.add_request(req("c", 1, max_tokens=1, base=60, arrival_time=2.0))
    for _ in range(10):
        out = step(s)
        if out.preempted_ids:
            assert all(e.request.request_id != "c" for e in out.scheduled)
            break
    else:
        pytest.fail("expected a preemption")


def test_rejections_name_the_numbers():
    s = make(num_blocks=5, max_model_len=32)
    with pytest.raises(RequestRejectedError, match=r"20 prompt tokens \+ max_tokens=13 = 33"):
        s.add_request(req("a", 20, max_tokens=13))
    with pytest.raises(RequestRejectedError, match="may need 6 KV-cache blocks.*only 4 usable"):
        s.add_request(req("b", 20, max_tokens=4))
    with pytest.raises(RequestRejectedError, match="empty prompt"):
        s.add_request(Request("c", [], 4))
    assert isinstance(RequestRejectedError("x"), ValueError)
    assert s.stats().num_rejected == 3 and not s.has_unfinished()
    s.add_request(req("ok", 12, max_tokens=4))  # exactly 4 blocks
    with pytest.raises(ValueError, match="already queued"):
        s.add_request(req("ok", 1))


def test_abort_waiting_and_running_and_unknown():
    s = make(max_tokens=4)
    s.add_request(req("run", 6, arrival_time=0.0))
    s.add_request(req("wait", 6, base=20, arrival_time=1.0))
    step(s)
    assert s.get_request("run").status is RequestStatus.RUNNING
    assert s.get_request("wait").status is RequestStatus.WAITING
    wait = s.get_request("wait")
    s.finish_request("wait", RequestStatus.FINISHED_ABORTED)
    assert wait.status is RequestStatus.FINISHED_ABORTED
    run = s.get_request("run")
    s.finish_request("run", RequestStatus.FINISHED_ABORTED)
    s.finish_request("run", RequestStatus.FINISHED_ABORTED)  # idempotent
    s.finish_request("never", RequestStatus.FINISHED_STOPPED)
    assert run.status is RequestStatus.FINISHED_ABORTED
    assert not s.has_unfinished() and s.num_used_blocks == 0
    assert step(s).is_empty
    with pytest.raises(ValueError, match="finished status"):
        s.finish_request("x", RequestStatus.RUNNING)


def test_abort_between_schedule_and_update():
    s = make()
    s.add_request(req("a", 5))
    out = s.schedule()
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    s.update_from_output(out, {"a": [1]})
    assert out.scheduled[0].request.output_token_ids == []
    check_invariants(s)
    assert s.num_used_blocks == 0


def test_fork_shares_prompt_blocks_and_copies_on_write():
    s = make(max_tokens=16)
    parent = req("p", 6, max_tokens=3)
    s.add_request(parent)
    out = s.schedule()
    s.update_from_output(out, {"p": [40]})
    children = [
        Request(f"p#{i}", parent.prompt_token_ids, 3, output_token_ids=[40 + i]) for i in (1, 2)
    ]
    s.fork_request("p", children)
    assert all(c.status is RequestStatus.RUNNING and c.num_computed_tokens == 6 for c in children)
    assert all(c.parent_id == "p" for c in children)
    tables = [s.kv.block_tables(r) for r in ("p", "p#1", "p#2")]
    assert tables[0] == tables[1] == tables[2]
    shared_partial = tables[0][0][1]
    assert s.kv.pool.ref_cnt[shared_partial] == 3
    check_invariants(s)
    out = s.schedule()
    assert [e.request.request_id for e in out.scheduled] == ["p", "p#1", "p#2"]
    # The parent and the first child write into the shared block: two copies; the last
    # holder writes in place.
    assert len(out.blocks_to_copy) == 2
    assert all(src == shared_partial for src, _ in out.blocks_to_copy)
    assert s.kv.pool.ref_cnt[shared_partial] == 1
    s.update_from_output(out, {"p": [1], "p#1": [2], "p#2": [3]})
    check_invariants(s)
    for r in ("p", "p#1", "p#2"):
        s.finish_request(r, RequestStatus.FINISHED_STOPPED)
    assert s.num_used_blocks == 0


def test_fork_validation():
    s = make()
    s.add_request(req("p", 4))
    with pytest.raises(ValueError, match="not a running request"):
        s.fork_request("p", [req("c", 4)])
    s.update_from_output(s.schedule(), {"p": [9]})
    with pytest.raises(ValueError, match="parent's prompt"):
        s.fork_request("p", [Request("c", [1, 2, 3, 4], 4, output_token_ids=[1])])
    with pytest.raises(ValueError, match="first sampled token"):
        s.fork_request("p", [req("c", 4)])
    with pytest.raises(ValueError, match="already in use"):
        s.fork_request("p", [Request("p", [0, 1, 2, 3], 4, output_token_ids=[1])])
    assert len(s.running) == 1


def test_sliding_window_groups_release_blocks():
    groups = [KVCacheGroupSpec(), KVCacheGroupSpec(sliding_window=8)]
    s = make(num_blocks=64, max_tokens=64, groups=groups)
    s.add_request(req("a", 40, max_tokens=10))
    out = step(s)
    full, window = out.scheduled[0].block_ids
    assert len(full) == len(window) == 10
    out = step(s)  # query at 40 reads 33..40: blocks 0..7 (positions 0..31) are dead
    full, window = out.scheduled[0].block_ids
    assert window[:8] == [0] * 8 and 0 not in window[8:] and 0 not in full
    assert len(full) == len(window) == 11  # position 40 opened block 10
    assert s.num_used_blocks == 11 + 3


def test_prefix_hits_and_stats():
    s = make(max_tokens=64)
    s.add_request(req("a", 17, max_tokens=2))
    while s.has_unfinished():
        step(s)
    s.add_request(req("b", 17, max_tokens=2))
    out = step(s)
    assert plan(out) == [("b", 16, 1, True)]  # all full blocks reused, the last token computed
    assert s.get_request("b").num_cached_tokens == 16
    st = s.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (34, 16)
    assert st.prefix_cache_hit_rate == pytest.approx(16 / 34)
    assert st.num_running == 1 and st.num_waiting == 0
    assert st.num_used_blocks == 5 and st.num_total_blocks == 63
    assert st.kv_usage == pytest.approx(5 / 63)
    assert st.kv_waste == pytest.approx(3 / 20)  # 17 computed tokens in 5 blocks of 4


def test_blocks_filled_by_decoding_are_cached():
    s = make(max_tokens=64)
    a = req("a", 6, max_tokens=6)
    s.add_request(a)
    while s.has_unfinished():
        step(s, token=len(a.output_token_ids) + 100)
    # a computed positions 0..10 (its last sampled token is never fed back): blocks 0 and 1
    # are full, block 1 filled up during decoding.
    s.add_request(Request("b", a.prompt_token_ids + a.output_token_ids, 1))
    assert plan(step(s)) == [("b", 8, 4, True)]


def test_simulated_mixed_workload_is_consistent():
    # A smoke run of the engine-like loop used by the property tests, fully checked.
    reqs = [
        SimRequest(f"r{i}", [(i * 7 + j) % 13 for j in range(3 + 5 * i)], 3 + i, arrival_step=i)
        for i in range(6)
    ]
    reqs.append(SimRequest("fork", list(range(9)), 4, n=3))
    big = run_simulation(make(num_blocks=200, max_tokens=64), reqs)
    small = run_simulation(make(num_blocks=12, max_tokens=6, max_seqs=3), reqs)
    assert not big.rejected and not small.rejected
    assert big.outputs == small.outputs
    assert len(big.outputs) == 6 + 3
