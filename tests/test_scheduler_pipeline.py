"""The scheduler under pipeline parallelism (device-free): one micro-batch per stage in flight.

With ``pipeline_parallel_size=2`` and asynchronous scheduling's accounting, consecutive steps
take disjoint requests (a request whose sampled token is still in flight waits: the first stage
could not embed it in time), about half of the running requests each, and every request still
gets its tokens in order.
"""

from __future__ import annotations

from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache_manager import KVCacheGroupSpec
from engine.request import PLACEHOLDER_TOKEN, Request, RequestStatus
from engine.scheduler import Scheduler


def make(pp: int = 2, max_tokens: int = 256) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_tokens, async_scheduling=True),
        CacheConfig(block_size=4),
        128,
        256,
        [KVCacheGroupSpec()],
        pipeline_parallel_size=pp,
    )


def inputs(step) -> list[int]:
    return [s.request.all_token_ids[s.start + s.num_new_tokens - 1] for s in step.scheduled]


def test_micro_batches_in_flight_are_disjoint_and_split_the_running_requests():
    scheduler = make()
    for i in range(8):
        scheduler.add_request(Request(f"r{i}", [10 + i] * 4, max_tokens=3))
    a = scheduler.schedule()  # every prompt: nothing is in flight yet
    assert len(a.scheduled) == 8
    assert scheduler.schedule().is_empty  # all their next tokens are in flight
    scheduler.update_from_output(a, {s.request.request_id: [1] for s in a.scheduled})
    b = scheduler.schedule()
    c = scheduler.schedule()
    ids_b = {s.request.request_id for s in b.scheduled}
    ids_c = {s.request.request_id for s in c.scheduled}
    assert len(ids_b) == len(ids_c) == 4 and not ids_b & ids_c
    assert scheduler.schedule().is_empty
    assert PLACEHOLDER_TOKEN not in inputs(b) + inputs(c)  # inputs are always known
    scheduler.update_from_output(b, {rid: [2] for rid in ids_b})
    d = scheduler.schedule()
    assert {s.request.request_id for s in d.scheduled} == ids_b  # back as soon as known


def test_every_request_finishes_with_its_tokens_in_order():
    scheduler = make(max_tokens=6)  # chunked prompts too
    for i in range(5):
        scheduler.add_request(Request(f"r{i}", list(range(1, 8 + i)), max_tokens=6))
    in_flight = []
    produced: dict[str, list[int]] = {}
    for _ in range(200):
        step = scheduler.schedule()
        if not step.is_empty:
            assert PLACEHOLDER_TOKEN not in inputs(step)
            in_flight.append(step)
        if len(in_flight) > 2 or (step.is_empty and in_flight):
            done = in_flight.pop(0)
            sampled = {}
            for s in done.scheduled:
                if s.samples:
                    rid = s.request.request_id
                    sampled[rid] = [len(produced.setdefault(rid, [])) + 100]
                    produced[rid].append(sampled[rid][0])
            scheduler.update_from_output(done, sampled)
            for s in done.scheduled:
                r = s.request
                if not r.is_finished and r.num_output_tokens >= r.max_tokens:
                    scheduler.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
        if not scheduler.has_unfinished() and not in_flight:
            break
    assert produced == {f"r{i}": [100 + k for k in range(6)] for i in range(5)}
    assert scheduler.num_used_blocks == 0


def test_a_request_preempted_with_its_token_in_flight_waits_for_it():
    scheduler = make()
    request = Request("a", [1, 2, 3], max_tokens=4)
    scheduler.add_request(request)
    first = scheduler.schedule()  # samples a token: a placeholder in flight
    scheduler._preempt(request)  # as a full cache would, while the step is in flight
    assert scheduler.schedule().is_empty  # not readmitted with an unknown input token
    scheduler.update_from_output(first, {"a": [9]})
    resumed = scheduler.schedule()
    assert [s.request.request_id for s in resumed.scheduled] == ["a"]
    assert PLACEHOLDER_TOKEN not in request.all_token_ids[: resumed.scheduled[0].num_new_tokens]
