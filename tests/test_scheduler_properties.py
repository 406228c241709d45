"""Property tests: random workloads through a simulated engine loop, checked after every step.

Each example draws a cache and scheduler configuration (tiny capacities included), KV-cache
groups (full, sliding-window, or both) and requests with random arrivals, prompts sharing
prefixes, output lengths, priorities, ``n > 1`` forks, cache salts and aborts. The simulation
(``engine.testing.scheduler_sim``) writes simulated KV content through the block tables and
reads every request's context back, so a wrong prefix hit, a shared block written twice or a
block freed too early fails the run. After every step it checks block accounting (no leak, no
double free, ref counts equal table occurrences), exact table coverage, the token budget and
``max_num_seqs``; at the end, that every request finished or was rejected, that rejection was
warranted, and that outputs equal those of an unconstrained run (no preemption, no chunking).
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache_manager import KVCacheGroupSpec
from engine.scheduler import Scheduler
from engine.testing.scheduler_sim import SimRequest, run_simulation

MAX_MODEL_LEN = 48
SETTINGS = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 4, 8]))
    window = draw(st.integers(1, 12))
    groups = draw(
        st.sampled_from(
            [
                [KVCacheGroupSpec()],
                [KVCacheGroupSpec()],
                [KVCacheGroupSpec(), KVCacheGroupSpec(window)],
                [KVCacheGroupSpec(window)],
                [KVCacheGroupSpec(), KVCacheGroupSpec()],
            ]
        )
    )
    config = dict(
        block_size=block_size,
        groups=groups,
        max_tokens=draw(st.integers(1, 24)),
        max_seqs=draw(st.integers(1, 6)),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        caching=draw(st.sampled_from([True, True, True, False])),
        chunked=draw(st.sampled_from([True, True, True, False])),
    )
    base = draw(st.lists(st.integers(0, 3), min_size=32, max_size=32))
    requests = []
    for i in range(draw(st.integers(1, 10))):
        prompt = base[: draw(st.integers(0, 28))] + draw(st.lists(st.integers(0, 9), max_size=8))
        requests.append(
            SimRequest(
                request_id=f"r{i}",
                prompt=prompt or [1],
                max_tokens=draw(st.integers(1, 12)),
                arrival_step=draw(st.integers(0, 5)),
                priority=draw(st.integers(0, 3)),
                n=draw(st.sampled_from([1, 1, 1, 2, 3])),
                abort_step=draw(st.none() | st.none() | st.integers(0, 30)),
                cache_salt=draw(st.sampled_from([None, None, None, "tenant"])),
            )
        )
    # Mostly a cache that fits the largest request but not all of them at once (contention,
    # preemption); sometimes any tiny size (rejections).
    largest = max(blocks_needed({**config, "num_blocks": 0}, r) for r in requests)
    if draw(st.integers(0, 7)) == 0:
        config["num_blocks"] = draw(st.integers(2, 48))
    else:
        config["num_blocks"] = 1 + largest + draw(st.integers(0, largest))
    return config, requests


def blocks_needed(config, spec: SimRequest) -> int:
    """Independent statement of the most blocks one request may hold at once."""
    bs = config["block_size"]
    total = len(spec.prompt) + spec.max_tokens
    blocks = 0
    for group in config["groups"]:
        full = -(-total // bs)
        if group.sliding_window is None:
            blocks += full
        else:
            span = group.sliding_window - 1 + min(config["max_tokens"], total)
            blocks += min(full, -(-span // bs) + 1)
    return blocks


def must_reject(config, spec: SimRequest) -> bool:
    """Independent statement of when a request can never run."""
    if len(spec.prompt) + spec.max_tokens > MAX_MODEL_LEN:
        return True
    if not config["chunked"] and len(spec.prompt) > config["max_tokens"]:
        return True
    return blocks_needed(config, spec) > config["num_blocks"] - 1


def build(config) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=config["max_seqs"],
            max_num_batched_tokens=config["max_tokens"],
            policy=config["policy"],
            enable_chunked_prefill=config["chunked"],
        ),
        CacheConfig(block_size=config["block_size"], enable_prefix_caching=config["caching"]),
        MAX_MODEL_LEN,
        config["num_blocks"],
        config["groups"],
    )


@SETTINGS
@given(scenarios())
def test_random_workloads_keep_every_invariant(scenario):
    config, requests = scenario
    scheduler = build(config)
    result = run_simulation(scheduler, requests, max_steps=3000)
    # Every request (and every forked child) finished by length, was aborted or rejected.
    assert result.rejected == {r.request_id for r in requests if must_reject(config, r)}
    for spec in requests:
        if spec.request_id in result.rejected:
            continue
        family = [spec.request_id] + [f"{spec.request_id}#{i}" for i in range(1, spec.n)]
        for rid in family:
            if rid in result.outputs:
                assert len(result.outputs[rid]) == spec.max_tokens
            else:
                # Only an abort ends a request early; the children of a parent aborted
                # before its first sample were never forked.
                assert rid in result.aborted or spec.request_id in result.aborted
    assert not scheduler.has_unfinished()
    assert scheduler.num_used_blocks == 0
    stats = scheduler.stats()
    event(f"preempted: {stats.num_preemptions > 0}")
    event(f"prefix hits: {stats.prefix_cache_hits > 0}")
    event(f"forked: {any('#' in rid for rid in result.outputs)}")
    event(f"all rejected: {len(result.rejected) == len(requests)}")
    assert stats.num_running == stats.num_waiting == 0
    assert stats.prefix_cache_hits <= stats.prefix_cache_queries


@SETTINGS
@given(scenarios())
def test_preemption_and_chunking_never_change_the_tokens(scenario):
    config, requests = scenario
    # The same arrivals without aborts, so both runs finish the same requests.
    requests = [
        SimRequest(**{**r.__dict__, "abort_step": None})
        for r in requests
        if not must_reject(config, r)
    ]
    tight = build(config)
    got = run_simulation(tight, requests, max_steps=3000)
    roomy_config = {
        **config,
        "num_blocks": 2048,
        "max_tokens": 1024,
        "max_seqs": 64,
        "chunked": True,
    }
    want = run_simulation(build(roomy_config), requests, max_steps=3000)
    assert not want.rejected and not got.rejected
    assert got.outputs == want.outputs
