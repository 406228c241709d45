"""The scheduler's LoRA limit, device-free: at most ``max_loras`` adapters per step, adapters
rotate so that more of them than slots all complete, a held-back request is never overtaken
by a later one with an adapter (requests without one still pass), and prefix hits never cross
adapters. The simulation writes each token's adapter into its simulated KV, so a cross-adapter
hit, a leaked block or a wrong table shows up as a wrong read-back."""

from __future__ import annotations

import random

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache_manager import KVCacheGroupSpec
from engine.lora.config import LoRAConfig
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.testing.scheduler_sim import SimRequest, check_invariants, run_simulation


def make(max_loras=2, num_blocks=128, max_tokens=24, max_seqs=8, policy="fcfs", lora=True):
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens, policy=policy),
        CacheConfig(block_size=4),
        256,
        num_blocks,
        [KVCacheGroupSpec()],
        lora_config=LoRAConfig(max_loras=max_loras) if lora else None,
    )


def workload(seed: int, num: int = 40, adapters: int = 5) -> list[SimRequest]:
    rng = random.Random(seed)
    shared = [rng.randrange(50) for _ in range(12)]
    out = []
    for i in range(num):
        prompt = ([] if rng.random() < 0.5 else list(shared)) + [
            rng.randrange(50) for _ in range(rng.randrange(1, 20))
        ]
        out.append(
            SimRequest(
                f"r{i}",
                prompt,
                rng.randrange(1, 12),
                arrival_step=rng.randrange(8),
                priority=rng.randrange(3),
                lora_id=rng.randrange(adapters + 1),  # 0: no adapter
                n=2 if rng.random() < 0.1 else 1,
            )
        )
    return out


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", range(4))
def test_more_adapters_than_max_loras_all_complete_with_unchanged_outputs(seed, policy):
    """Five adapters through two slots, with preemption (a small cache): every request
    completes, no step exceeds two adapters, nothing leaks, and each request's tokens are the
    ones it gets without the limit (its KV was never another adapter's)."""
    reqs = workload(seed)
    limited = run_simulation(make(max_loras=2, num_blocks=40, policy=policy), reqs)
    free = run_simulation(make(max_loras=5, policy=policy), reqs)
    plain = run_simulation(make(lora=False, policy=policy), reqs)
    assert limited.outputs == free.outputs == plain.outputs
    assert len(limited.outputs) == sum(r.n for r in reqs)


def _step(s: Scheduler) -> list[str]:
    out = s.schedule()
    s.update_from_output(out, {e.request.request_id: [1] for e in out.scheduled if e.samples})
    for e in out.scheduled:
        r = e.request
        if s.get_request(r.request_id) is not None and len(r.output_token_ids) >= r.max_tokens:
            s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
    check_invariants(s)
    return [e.request.request_id for e in out.scheduled]


def _req(rid, lora, max_tokens=3, t=0.0):
    return Request(rid, [1, 2, 3], max_tokens, arrival_time=t, lora_id=lora)


def test_a_held_back_request_is_not_overtaken_by_later_adapters():
    s = make(max_loras=1)
    s.add_request(_req("a1", 1, max_tokens=3, t=0))
    s.add_request(_req("b1", 2, t=1))  # adapter 2 does not fit while adapter 1 runs
    s.add_request(_req("a2", 1, t=2))  # adapter 1 runs, but b1 came first
    s.add_request(_req("base", 0, t=3))  # no adapter: takes no slot, passes
    assert _step(s) == ["a1", "base"]
    assert s.waiting.peek().request_id == "b1" and len(s.waiting) == 2  # order kept
    assert _step(s) == ["a1", "base"]
    assert _step(s) == ["a1", "base"]  # a1 and base finish (3 tokens)
    assert s.lora.running_adapters == set()
    assert _step(s) == ["b1"]  # b1 goes first; a2 waits for adapter 2 to drain
    assert _step(s) == ["b1"]
    assert _step(s) == ["b1"]
    assert _step(s) == ["a2"]
    while s.has_unfinished():
        _step(s)
    assert s.num_free_blocks == s.kv.num_usable_blocks


def test_requests_of_running_adapters_are_admitted_while_slots_are_free():
    s = make(max_loras=2)
    for i, lora in enumerate([1, 2, 1, 2, 0, 1]):
        s.add_request(_req(f"r{i}", lora, t=i))
    assert sorted(_step(s)) == [f"r{i}" for i in range(6)]
    assert s.lora.running_adapters == {1, 2}


def test_preempted_request_gives_its_adapter_slot_back():
    s = make(max_loras=1, num_blocks=4, max_tokens=8)  # 3 usable blocks of 4 tokens
    s.add_request(Request("x", list(range(6)), 6, arrival_time=0.0, lora_id=1))
    s.add_request(Request("y", list(range(10, 14)), 6, arrival_time=1.0, lora_id=1))
    _step(s)
    assert s.lora.running_adapters == {1}
    while s.has_unfinished():
        _step(s)
    assert s.num_preemptions >= 1
    assert s.lora.running_adapters == set()
    assert s.num_free_blocks == s.kv.num_usable_blocks


def test_aborting_running_and_waiting_requests_releases_adapters():
    s = make(max_loras=1)
    s.add_request(_req("a", 1, max_tokens=10))
    s.add_request(_req("b", 2, max_tokens=10, t=1))
    _step(s)
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)  # waiting
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)  # running
    assert s.lora.running_adapters == set() and not s.has_unfinished()
    assert s.num_free_blocks == s.kv.num_usable_blocks


def test_prefix_hits_stay_within_an_adapter():
    s = make(max_loras=3)
    prompt = list(range(17))
    for i, lora in enumerate([1, 1, 2, 0, 2]):
        r = Request(f"r{i}", prompt, 1, arrival_time=float(i), lora_id=lora)
        s.add_request(r)
        while s.has_unfinished():
            _step(s)
        assert r.num_cached_tokens == (16 if i in (1, 4) else 0), (i, lora)
