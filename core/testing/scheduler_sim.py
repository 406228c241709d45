"""A device-free simulation of the engine loop around the ``Scheduler``, for tests and benchmarks.

``KVContentSim`` plays the model runner's part of the paged KV cache: it applies copy-on-write
copies, writes ``(position, token)`` into the slot of every scheduled token, and reads each
request's visible context back through its block tables, so any block-table bug (a shared block
written by two requests, a prefix hit on the wrong content, a freed block still in use) shows up
as a wrong read-back. ``fake_next_token`` is a deterministic "model": the next token is a hash of
what was read back, so a request produces the same tokens however it was scheduled, chunked or
preempted -- unless its KV was corrupted.

``run_simulation`` drives ``schedule -> write/read KV -> update_from_output -> stop checks`` like
``EngineCore`` does (including ``n > 1`` forks after the first sample and aborts), and
``check_invariants`` verifies the block accounting after every step.

A request with a LoRA adapter (``SimRequest.lora_id``) writes ``(position, token, adapter)``:
the same tokens under another adapter are other KV, as in a real model, so a prefix hit across
adapters reads back the wrong content; and no step may hold more than the scheduler's
``max_loras`` adapters.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any

from engine.block_pool import NULL_BLOCK_ID
from engine.request import Request, RequestStatus
from engine.scheduler import RequestRejectedError, Scheduler
from engine.scheduler_output import SchedulerOutput


def fake_next_token(context: list[tuple[int, int]], sample_index: int = 0, vocab: int = 50) -> int:
    """A deterministic "model": the next token from the (position, token) pairs it can see."""
    digest = hashlib.blake2b(repr((context, sample_index)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % vocab


class KVContentSim:
    """What a model runner would hold in the paged KV cache: slot -> (position, token)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.block_size
        self.windows = [g.sliding_window for g in scheduler.kv.groups]
        self.slots: dict[int, tuple[int, int]] = {}

    def apply_copies(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write copies, all reads before writes (as a batched gather/scatter does)."""
        bs = self.block_size
        snapshot = [[self.slots.get(src * bs + o) for o in range(bs)] for src, _ in pairs]
        for (_, dst), values in zip(pairs, snapshot, strict=True):
            for o, value in enumerate(values):
                if value is None:
                    self.slots.pop(dst * bs + o, None)
                else:
                    self.slots[dst * bs + o] = value

    def run_step(self, out: SchedulerOutput) -> dict[str, list[tuple[int, int]]]:
        """Write every scheduled token's KV, then return for each request the context its last
        new query sees in group 0, after checking every group reads back exactly the request's
        own tokens."""
        bs = self.block_size
        self.apply_copies(out.blocks_to_copy)
        for entry in out.scheduled:
            tokens = step_tokens(entry)
            for table in entry.block_ids:
                for pos in range(entry.start, entry.start + entry.num_new_tokens):
                    block = table[pos // bs]
                    assert block != NULL_BLOCK_ID, f"position {pos} maps to the null block"
                    self.slots[block * bs + pos % bs] = _kv(pos, tokens[pos], entry.request)
        contexts = {}
        for entry in out.scheduled:
            request = entry.request
            tokens = step_tokens(entry)
            end = entry.start + entry.num_new_tokens
            for g, table in enumerate(entry.block_ids):
                # Exactly the step's tokens, plus a proposer's look-ahead slots.
                assert -(-end // bs) <= len(table) <= -(-(end + entry.num_to_propose) // bs), (
                    f"{request.request_id}: group {g} table has {len(table)} blocks for {end} "
                    "tokens"
                )
                window = self.windows[g]
                # The first new query (at entry.start) sees the oldest keys of the step.
                lo = 0 if window is None else max(0, entry.start - window + 1)
                got = [self.slots.get(table[p // bs] * bs + p % bs) for p in range(lo, end)]
                want = [_kv(p, tokens[p], request) for p in range(lo, end)]
                assert got == want, (
                    f"{request.request_id}: group {g} reads back the wrong KV for positions "
                    f"{lo}..{end - 1}"
                )
                if g == 0:
                    # What each query that samples sees: the last one, or for a verification
                    # each of its last 1 + k positions.
                    seen = []
                    for q in range(end - 1 - len(entry.spec_token_ids), end):
                        q_lo = 0 if window is None else max(0, q - window + 1)
                        seen.append(got[q_lo - lo : q + 1 - lo])
                    contexts[request.request_id] = seen
        return contexts


def step_tokens(entry: Any) -> list[int]:
    """The tokens of a scheduled entry's request as the step sees them: its known tokens,
    then the draft tokens it verifies."""
    tokens = entry.request.all_token_ids
    if entry.spec_token_ids:
        tokens = tokens[: entry.start + entry.num_known_tokens] + list(entry.spec_token_ids)
    return tokens


def true_continuation(tokens: list[int], num: int, window: int | None, vocab: int) -> list[int]:
    """The next ``num`` tokens the fake model would produce after ``tokens`` (what a perfect
    drafter proposes): query at ``p`` sees the ``(position, token)`` pairs of its window."""
    tokens = list(tokens)
    out = []
    for _ in range(num):
        q = len(tokens) - 1
        lo = 0 if window is None else max(0, q - window + 1)
        nxt = fake_next_token([(p, tokens[p]) for p in range(lo, q + 1)], 0, vocab)
        tokens.append(nxt)
        out.append(nxt)
    return out


def _kv(position: int, token: int, request: Request) -> tuple[int, ...]:
    """What the KV of one token stands for: its position and token, and its adapter."""
    return (position, token, request.lora_id) if request.lora_id else (position, token)


def check_invariants(scheduler: Scheduler, mid_step: bool = False) -> None:
    """Block accounting: every held block's reference count equals the number of tables
    holding it, the free queue holds exactly the unreferenced blocks, tables cover exactly the
    computed (+ scheduled, when ``mid_step``) tokens, and waiting requests hold nothing."""
    kv = scheduler.kv
    pool = kv.pool
    bs = kv.block_size
    refs = [0] * pool.num_blocks
    for rid, st in kv._reqs.items():
        request = scheduler.get_request(rid)
        assert request is not None, f"KV state for unknown request {rid}"
        if request.status is not RequestStatus.RUNNING:
            assert all(not t for t in st.tables), f"waiting request {rid} holds blocks"
            assert request.num_computed_tokens == 0
            continue
        if not mid_step:
            assert st.num_tokens == request.num_computed_tokens, (
                f"{rid}: tables cover {st.num_tokens} tokens, {request.num_computed_tokens} "
                "computed"
            )
            if kv.enable_prefix_caching:  # every full computed block was offered to the cache
                assert st.num_cached_blocks == request.num_computed_tokens // bs, rid
        for g, table in enumerate(st.tables):
            assert len(table) == -(-st.num_tokens // bs), f"{rid}: group {g} table size"
            window = kv.groups[g].sliding_window
            for i, block in enumerate(table):
                if block == NULL_BLOCK_ID:
                    assert window is not None and i < st.num_dead[g], f"{rid}: stray null block"
                else:
                    refs[block] += 1
    free = pool.free_block_ids()
    assert len(free) == len(set(free)), "a block is twice in the free queue"
    assert NULL_BLOCK_ID not in free
    assert pool.ref_cnt[NULL_BLOCK_ID] == 0
    for block in range(1, pool.num_blocks):
        assert pool.ref_cnt[block] == refs[block], (
            f"block {block}: ref count {pool.ref_cnt[block]} but held by {refs[block]} tables"
        )
        assert (refs[block] == 0) == pool.is_free(block), f"block {block} free-queue mismatch"
    for g in range(kv.num_groups):
        for h, block in pool.group_index(g).items():
            assert pool.block_hash[block] == h, f"index entry for block {block} is stale"
    if not scheduler.has_unfinished():
        assert pool.num_free_blocks == pool.num_usable_blocks, "blocks leaked while idle"


@dataclass
class SimRequest:
    """A request the simulated engine will add at ``arrival_step`` (``n`` completions)."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    arrival_step: int = 0
    priority: int = 0
    n: int = 1
    abort_step: int | None = None
    cache_salt: str | None = None
    lora_id: int = 0


@dataclass
class SimResult:
    """Outputs of finished-by-length sequences, rejected and aborted ids, and per-step data."""

    outputs: dict[str, list[int]] = field(default_factory=dict)
    rejected: set[str] = field(default_factory=set)
    aborted: set[str] = field(default_factory=set)
    num_steps: int = 0
    max_kv_waste_at_peak: float = 0.0
    peak_usage: float = 0.0


def run_simulation(
    scheduler: Scheduler,
    requests: list[SimRequest],
    max_steps: int = 10_000,
    check: bool = True,
    vocab: int = 50,
    draft_accuracy: float | None = None,
    seed: int = 0,
) -> SimResult:
    """Drive the scheduler like the engine does until every request finished or was rejected.

    With ``check`` it simulates the KV content and checks the invariants and per-step limits
    after every step; raises ``AssertionError`` on any violation and when ``max_steps`` pass.

    ``draft_accuracy`` (a scheduler built with a ``speculative_config``) proposes drafts after
    each step that asks for them: each draft token is the model's true next token with that
    probability (else a random one), and a verification keeps drafts while they equal what
    the fake model computes from the KV read back, as greedy verification does; the outputs
    must equal a run without speculation.
    """
    rng = random.Random(seed)
    result = SimResult()
    kv_sim = KVContentSim(scheduler) if check else None
    cfg = scheduler.scheduler_config
    by_step: dict[int, list[SimRequest]] = {}
    for spec in requests:
        by_step.setdefault(spec.arrival_step, []).append(spec)
    last_arrival = max(by_step, default=0)
    n_of: dict[str, int] = {}  # parents still to fork -> n
    family: dict[str, list[str]] = {}
    aborts: dict[int, list[str]] = {}
    forked = False
    step = 0
    while step <= last_arrival or scheduler.has_unfinished():
        assert step < max_steps, f"no progress after {max_steps} steps"
        for spec in by_step.get(step, []):
            request = Request(
                spec.request_id,
                list(spec.prompt),
                spec.max_tokens,
                arrival_time=float(step),
                priority=spec.priority,
                cache_salt=spec.cache_salt,
                lora_id=spec.lora_id,
            )
            try:
                scheduler.add_request(request)
            except RequestRejectedError:
                result.rejected.add(spec.request_id)
                continue
            family[spec.request_id] = [spec.request_id]
            if spec.n > 1:
                n_of[spec.request_id] = spec.n
            if spec.abort_step is not None:
                aborts.setdefault(max(spec.abort_step, step), []).append(spec.request_id)
        for rid in aborts.pop(step, []):
            for member in family.get(rid, []):
                if scheduler.get_request(member) is not None:
                    scheduler.finish_request(member, RequestStatus.FINISHED_ABORTED)
                    result.aborted.add(member)
            n_of.pop(rid, None)
        step += 1

        out = scheduler.schedule()
        if check:
            assert out.num_batched_tokens <= cfg.max_num_batched_tokens
            assert out.num_batched_tokens == sum(e.num_new_tokens for e in out.scheduled)
            assert len(out.scheduled) <= cfg.max_num_seqs
            ids = [e.request.request_id for e in out.scheduled]
            assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
            assert not set(ids) & set(out.preempted_ids)
            kinds = [e.is_decode for e in out.scheduled]
            assert kinds == sorted(kinds, reverse=True), "decodes must come first"
            for e in out.scheduled:
                assert e.num_new_tokens >= 1
                assert e.samples == (e.start + e.num_known_tokens == e.request.num_tokens)
                assert not e.spec_token_ids or e.num_known_tokens == 1
            if not forked:
                assert len(scheduler.running) <= cfg.max_num_seqs
            if scheduler.lora is not None:
                adapters = {e.request.lora_id for e in out.scheduled} - {0}
                assert len(adapters) <= scheduler.lora.max_loras, f"step uses {adapters}"
            check_invariants(scheduler, mid_step=True)
            stats = scheduler.stats()
            if stats.kv_usage >= result.peak_usage:
                result.peak_usage = stats.kv_usage
                result.max_kv_waste_at_peak = stats.kv_waste
        if out.is_empty:
            continue
        contexts = kv_sim.run_step(out) if kv_sim is not None else {}

        sampled: dict[str, list[int]] = {}
        fork_tokens: dict[str, list[int]] = {}
        for e in out.scheduled:
            if not e.samples:
                continue
            rid = e.request.request_id
            seen = contexts.get(rid)
            if seen is None:  # unchecked run: the request's own history
                seen = [list(enumerate(step_tokens(e)))[: e.start + e.num_known_tokens + j]
                        for j in range(len(e.spec_token_ids) + 1)]  # fmt: skip
            context = seen[0]
            if rid in n_of:
                fork_tokens[rid] = [
                    fake_next_token(context, i, vocab) for i in range(n_of.pop(rid))
                ]
                sampled[rid] = fork_tokens[rid][:1]
            else:
                # Greedy verification: keep drafts while they equal the model's token.
                tokens = [fake_next_token(context, 0, vocab)]
                for j, draft in enumerate(e.spec_token_ids, start=1):
                    if draft != tokens[-1]:
                        break
                    tokens.append(fake_next_token(seen[j], 0, vocab))
                sampled[rid] = tokens
        scheduler.update_from_output(out, sampled)
        if draft_accuracy is not None:
            window = scheduler.kv.groups[0].sliding_window
            drafts = {}
            for e in out.scheduled:
                request = e.request
                if not e.num_to_propose or scheduler.get_request(request.request_id) is None:
                    continue
                true = true_continuation(request.all_token_ids, e.num_to_propose, window, vocab)
                drafts[request.request_id] = [
                    t if rng.random() < draft_accuracy else rng.randrange(vocab) for t in true
                ]
            scheduler.update_draft_token_ids(drafts)

        done_check = [rid for rid in sampled]
        for rid, tokens in fork_tokens.items():
            parent = scheduler.get_request(rid)
            children = [
                Request(
                    f"{rid}#{i}",
                    parent.prompt_token_ids,
                    parent.max_tokens,
                    arrival_time=parent.arrival_time,
                    priority=parent.priority,
                    output_token_ids=[tokens[i]],
                    cache_salt=parent.cache_salt,
                    lora_id=parent.lora_id,
                )
                for i in range(1, len(tokens))
            ]
            scheduler.fork_request(rid, children)
            forked = True
            for child in children:
                family[rid].append(child.request_id)
                done_check.append(child.request_id)
        for rid in done_check:
            request = scheduler.get_request(rid)
            if request is not None and len(request.output_token_ids) >= request.max_tokens:
                assert len(request.output_token_ids) == request.max_tokens, rid
                result.outputs[rid] = list(request.output_token_ids)
                scheduler.finish_request(rid, RequestStatus.FINISHED_LENGTH)
        if check:
            check_invariants(scheduler)
    result.num_steps = step
    if check:
        check_invariants(scheduler)
        assert scheduler.num_free_blocks == scheduler.kv.num_usable_blocks
    return result
