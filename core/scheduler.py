"""The continuous-batching scheduler: which tokens of which requests run in the next step.

Each ``schedule()`` call fills a per-step token budget (``max_num_batched_tokens``) and a
sequence budget (``max_num_seqs``), in this order:

1. running requests with one token to compute (decodes),
2. running requests still prefilling (continuing chunks of long prompts, or recomputation after
   preemption), each taking as much of the remaining budget as it needs,
3. waiting requests, in policy order (FCFS: arrival; priority: lower ``priority`` value first,
   then arrival), after a prefix-cache lookup; the first one that does not fit stops admission.

A long prompt is therefore split over several steps and mixed with the decodes of others
(chunked prefill). When a running request cannot get a block, the scheduler preempts by
recompute: the victim is the running request with the lowest priority (largest value; FCFS
ignores priorities), latest arrival last; it frees its blocks, resets ``num_computed_tokens`` to 0,
keeps its output tokens and goes back to the front of the waiting queue, to be resumed later by
recomputing prompt + outputs (often mostly from the prefix cache, as freed blocks keep their
hashes). No new request is admitted in a step that preempted.

**Pooling requests** (``Request.pooling_params`` set: embeddings) are never split into chunks,
whatever ``enable_chunked_prefill`` says: mean and CLS pooling need the hidden states of the
whole prompt from one forward (and an encoder attends both ways over all of it), so such a
request is admitted only when its whole prompt fits the step's budget, resumes whole after a
preemption, and is refused when its prompt exceeds ``max_num_batched_tokens``. It never uses
the prefix cache (a cached prefix's hidden states are not recomputed, and an encoder's keys
depend on later tokens), samples nothing, and the engine finishes it once its step completes.

With LoRA (``lora_config``), at most ``max_loras`` distinct adapters run at once
(``engine.lora.scheduling``): a waiting request whose adapter would exceed it is held back,
without blocking requests that need no new adapter slot, and no later request with an adapter
overtakes it.

The engine loop calls ``schedule`` -> runs the model -> ``update_from_output`` -> checks stop
conditions and calls ``finish_request``. Everything here is device-free.

**Asynchronous scheduling** (``SchedulerConfig.async_scheduling``) lets the engine schedule step
N+1 before step N's sampled tokens reach the host. ``schedule()`` then advances
``num_computed_tokens`` itself and appends a ``PLACEHOLDER_TOKEN`` for every token the step will
sample; ``update_from_output`` later writes the real token over it. A request whose placeholders
already reach ``max_tokens`` is not scheduled again: it finishes when its last token arrives.

**Speculative decoding** (``speculative_config``): a decode whose request carries draft tokens
(``Request.spec_token_ids``, set by ``update_draft_token_ids`` after a step) is scheduled with
them, ``1 + k`` tokens in one step (verifications are placed after plain decodes, before
prefills), clamped to the token budget and to what ``max_tokens`` can still use. In a step with
more running requests than ``disable_by_batch_size`` drafts are dropped and none are proposed.
``update_from_output`` keeps the accepted prefix: ``num_computed_tokens`` advances by the
tokens the step returned, and blocks past them (rejected drafts, a proposer's look-ahead
slots) go back to the pool, so only accepted tokens' full blocks are ever hashed. A
verification is accounted when it completes even with asynchronous scheduling: the engine
never schedules past a step that verifies or proposes.

**Pipeline parallelism** (``pipeline_parallel_size > 1``) keeps one micro-batch per stage in
flight, on asynchronous scheduling's accounting. A decode whose input is a placeholder is not
scheduled (the first stage would need the token before the last stage has sampled it): each
request is in at most one micro-batch in flight (a prompt's later chunks may follow its earlier
ones: their tokens are known and every stage runs the micro-batches in order). Running requests
are spread over the micro-batches, about ``len(running) / pipeline_parallel_size`` each.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from engine.kv_cache_manager import KVCacheGroupSpec, KVCacheManager
from engine.lora.scheduling import LoRAAdmission
from engine.multimodal.encoder_cache import EncoderBudget, EncoderCacheManager, EncoderPlan
from engine.request import PLACEHOLDER_TOKEN, Request, RequestStatus
from engine.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.spec_decode.stats import SpecDecodingStats

if TYPE_CHECKING:
    from engine.lora.config import LoRAConfig

_RUNNING = RequestStatus.RUNNING


class RequestRejectedError(ValueError):
    """A request that can never run with this configuration; the message names the numbers."""


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler and KV cache.

    ``kv_usage`` is the fraction of usable blocks held by requests. ``kv_waste`` is the fraction
    of held slots that hold no computed or scheduled token. Prefix-cache counters are in tokens
    (queries: tokens of admitted requests; hits: of which reused from the cache).
    """

    num_running: int
    num_waiting: int
    num_total_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    kv_usage: float
    kv_waste: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_rejected: int
    spec_decoding: SpecDecodingStats | None = None
    # Image inputs: images first reached by a request's chunk, and of which already cached.
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0


class _WaitingQueue:
    """Waiting requests in policy order. FCFS is a deque (preempted requests go back to the
    front); the priority policy is a heap keyed by (priority, arrival, admission order) with
    lazy removal."""

    def __init__(self, by_priority: bool) -> None:
        self._by_priority = by_priority
        self._deque: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._members: dict[str, Request] = {}

    def __len__(self) -> int:
        return len(self._members)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._members.values()))

    def push(self, request: Request, seq: int, front: bool = False) -> None:
        self._members[request.request_id] = request
        if self._by_priority:
            heapq.heappush(self._heap, (request.priority, request.arrival_time, seq, request))
        elif front:
            self._deque.appendleft(request)
        else:
            self._deque.append(request)

    def peek(self) -> Request | None:
        if not self._by_priority:
            return self._deque[0] if self._deque else None
        heap, members = self._heap, self._members
        while heap and members.get(heap[0][3].request_id) is not heap[0][3]:
            heapq.heappop(heap)  # removed while waiting
        return heap[0][3] if heap else None

    def pop(self) -> Request:
        request = self.peek()
        assert request is not None
        if self._by_priority:
            heapq.heappop(self._heap)
        else:
            self._deque.popleft()
        del self._members[request.request_id]
        return request

    def remove(self, request: Request) -> None:
        del self._members[request.request_id]
        if not self._by_priority:
            self._deque.remove(request)


class Scheduler:
    """Waiting and running queues over a ``KVCacheManager``; see the module docstring.

    ``num_blocks`` is the number of physical KV blocks per layer that the model runner
    allocates, including the reserved null block 0. ``kv_groups[g]`` describes KV-cache group
    ``g``; ``ScheduledRequest.block_ids[g]`` is a request's table for it. ``encoder_budget``
    (image inputs) is the per-step encoder budget and the encoder cache's size: the scheduler
    then acquires a request's images as its chunks reach them (``EncoderCacheManager``).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        num_blocks: int,
        kv_groups: list[KVCacheGroupSpec],
        speculative_config: SpeculativeConfig | None = None,
        *,
        pipeline_parallel_size: int = 1,
        encoder_budget: EncoderBudget | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        """``lora_config`` (None: LoRA off) limits the adapters per step to ``max_loras``."""
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(
            cache_config.block_size,
            num_blocks,
            kv_groups,
            enable_prefix_caching=cache_config.enable_prefix_caching,
        )
        self._max_tokens = scheduler_config.max_num_batched_tokens
        self._max_seqs = scheduler_config.max_num_seqs
        self._chunked = scheduler_config.enable_chunked_prefill
        self.async_output = bool(scheduler_config.async_scheduling)
        self._by_priority = scheduler_config.policy == "priority"
        self.waiting = _WaitingQueue(self._by_priority)
        self.running: list[Request] = []
        self._running_sorted = True
        self._requests: dict[str, Request] = {}
        self._seq: dict[str, int] = {}  # admission order, the last tie-break
        self._counter = itertools.count()
        self._no_prefix_hit: set[str] = set()
        # Pipeline parallelism: one micro-batch per stage in flight (see the module docstring).
        self._pp = max(1, pipeline_parallel_size)
        self.num_preemptions = 0
        self.num_rejected = 0
        # Speculative decoding: drafts per step (0: off), the look-ahead slots a proposer
        # writes past a step's tokens, and the largest batch that still speculates.
        spec = speculative_config
        self._spec_k = int(spec.num_speculative_tokens or 0) if spec is not None else 0
        self._lookahead = spec.num_lookahead_slots if spec is not None else 0
        self._spec_max_batch = int(spec.disable_by_batch_size or 0) if spec is not None else 0
        self.spec_stats = SpecDecodingStats(self._spec_k) if spec is not None else None
        # Image inputs: the encoder cache's mirror, this step's unused encoder budget and the
        # images this step encodes, per request.
        self.encoder_cache = EncoderCacheManager(encoder_budget) if encoder_budget else None
        self._enc_left = 0
        self._step_encodes: dict[str, list[str]] = {}
        self.lora = LoRAAdmission(lora_config.max_loras) if lora_config is not None else None

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request, *, allow_prefix_hit: bool = True) -> None:
        """Queue a new request. Raises ``RequestRejectedError`` when it could never run.

        ``allow_prefix_hit=False`` makes it compute its whole prompt even when a prefix is
        cached (a request that wants prompt logprobs needs logits at every prompt position);
        its blocks are still offered to the cache for others.
        """
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already queued or running")
        reason = self._rejection_reason(request)
        if reason is not None:
            request.status = RequestStatus.FINISHED_REJECTED
            self.num_rejected += 1
            raise RequestRejectedError(reason)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self._requests[rid] = request
        self._seq[rid] = next(self._counter)
        if not allow_prefix_hit or request.pooling_params is not None:
            self._no_prefix_hit.add(rid)
        self.kv.add_request(request)
        self.waiting.push(request, self._seq[rid])

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Drop a waiting or running request and free its blocks. Unknown ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"finish_request needs a finished status, got {status}")
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if request.status is _RUNNING:
            self.running.remove(request)
            if self.lora is not None:
                self.lora.stopped(request)
        else:
            self.waiting.remove(request)
        self.kv.remove(request_id)
        if self.encoder_cache is not None:
            self.encoder_cache.release_all(request_id)
        del self._seq[request_id]
        self._no_prefix_hit.discard(request_id)
        request.status = status

    def fork_request(self, parent_id: str, children: list[Request]) -> None:
        """Start ``children`` (``n > 1`` sampling) from a running parent: each becomes running
        with the parent's ``num_computed_tokens`` and shares the parent's blocks (the shared
        partial last block is copied on the first write). A child carries the parent's prompt
        and its own output tokens, and must have at least one token left to compute."""
        parent = self._requests.get(parent_id)
        if parent is None or parent.status is not _RUNNING:
            raise ValueError(f"fork_request: {parent_id!r} is not a running request")
        computed = parent.num_computed_tokens
        num_prompt = parent.num_prompt_tokens
        ids = set()
        for child in children:
            cid = child.request_id
            if cid in self._requests or cid in ids:
                raise ValueError(f"fork_request: request id {cid!r} is already in use")
            ids.add(cid)
            if child.prompt_token_ids != parent.prompt_token_ids:
                raise ValueError(f"fork_request: child {cid!r} must have its parent's prompt")
            if computed > num_prompt and (
                child.output_token_ids[: computed - num_prompt]
                != parent.output_token_ids[: computed - num_prompt]
            ):
                raise ValueError(
                    f"fork_request: child {cid!r} differs from its parent in tokens whose KV "
                    "is already computed"
                )
            if child.num_tokens <= computed:
                raise ValueError(
                    f"fork_request: child {cid!r} has {child.num_tokens} tokens, no more than "
                    f"the parent's {computed} computed ones; give it its first sampled token"
                )
            reason = self._rejection_reason(child)
            if reason is not None:
                raise RequestRejectedError(reason)
        for child in children:
            cid = child.request_id
            child.status = _RUNNING
            child.num_computed_tokens = computed
            child.parent_id = parent_id
            self._requests[cid] = child
            self._seq[cid] = next(self._counter)
            self.kv.fork(parent_id, child)
            self.running.append(child)
            if self.lora is not None:
                self.lora.started(child)
        self._running_sorted = False

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        """The waiting or running request with this id, or None."""
        return self._requests.get(request_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their content)."""
        self.kv.reset_prefix_cache()

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Give running requests the draft tokens proposed after the last step, for the next
        step to verify (speculative decoding). Unknown or finished ids are ignored."""
        requests = self._requests
        for rid, drafts in draft_token_ids.items():
            request = requests.get(rid)
            if request is not None and request.status is _RUNNING:
                request.spec_token_ids = list(drafts[: self._spec_k])

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.kv.num_used_blocks

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        """Decide the next step. ``block_ids`` in the result are the manager's live tables:
        read them before the next ``schedule()`` and never modify them."""
        allocate = self.kv.allocate_slots
        token_budget = self._max_tokens
        seq_budget = self._max_seqs
        if self._by_priority and not self._running_sorted:
            self.running.sort(key=self._priority_key)
            self._running_sorted = True
        decodes: list[ScheduledRequest] = []
        verifies: list[ScheduledRequest] = []  # decodes with draft tokens (speculative)
        prefills: list[ScheduledRequest] = []
        preempted: list[str] = []
        continuing: list[Request] = []
        entries = (decodes, verifies, prefills)
        # Speculative decoding in this step: only while the batch is small enough to pay.
        speculate = bool(self._spec_k) and len(self.running) <= self._spec_max_batch
        images = self.encoder_cache
        if images is not None:
            images.begin_step()
            self._enc_left = images.budget.max_tokens_per_step
            self._step_encodes = {}
        running_budget = seq_budget
        if self._pp > 1:
            # About 1/pp of the running requests per micro-batch, so each stage gets work.
            running_budget = min(seq_budget, -(-len(self.running) // self._pp))

        # 1. Decodes: running requests with exactly one token to compute. This loop is the hot
        # path of a busy engine: keep it to a few attribute reads per request.
        for request in self.running[:]:
            start = request.num_computed_tokens
            n = len(request.prompt_token_ids) + len(request.output_token_ids) - start
            if n != 1:
                if n > 1:
                    continuing.append(request)
                continue
            if token_budget <= 0 or seq_budget <= 0 or running_budget <= 0:
                break
            if preempted and request.status is not _RUNNING:
                continue  # preempted earlier in this pass
            if request.num_output_placeholders and (
                self._pp > 1 or len(request.output_token_ids) >= request.max_tokens
            ):
                # Its last token is still in flight (asynchronous scheduling): with pipeline
                # stages it cannot be fed back on the device in time, so the request waits.
                continue
            plan = None
            if images is not None and request.mm_features and start < len(request.prompt_token_ids):
                ok, plan = images.plan(request, start, 1, self._enc_left)  # a 1-token chunk
                if not ok:
                    continue
            drafts = request.spec_token_ids
            if speculate:
                if drafts:
                    request.spec_token_ids = []  # consumed by this step, verified or not
                    # The bonus token counts too: 1 + k tokens may not pass max_tokens.
                    k = min(
                        len(drafts),
                        token_budget - 1,
                        request.max_tokens - request.num_output_tokens - 1,
                    )
                    drafts = drafts[:k] if k > 0 else ()
                num_new = 1 + len(drafts)
                propose = self._num_to_propose(request, start, num_new)
                tables = allocate(request, num_new + (propose if self._lookahead else 0))
            else:
                if drafts:
                    request.spec_token_ids = []
                    drafts = ()
                num_new, propose = 1, 0
                tables = allocate(request, 1)
            if tables is None:
                tables, tokens_back, seqs_back = self._preempt_until_fits(
                    request,
                    num_new + (propose if self._lookahead else 0),
                    entries,
                    preempted,
                )
                token_budget += tokens_back
                seq_budget += seqs_back
                if tables is None:
                    continue
            if plan is not None:
                self._commit_images(request, plan)
            entry = ScheduledRequest(
                request, start, num_new, tables, request.pooling_params is None
            )
            if speculate:
                entry.num_to_propose = propose
                if drafts:
                    entry.spec_token_ids = drafts
            if drafts:
                verifies.append(entry)
            elif start >= len(request.prompt_token_ids):
                decodes.append(entry)
            else:
                prefills.append(entry)
            token_budget -= num_new
            seq_budget -= 1
            running_budget -= 1

        # 2. Continuing prefills (chunks of long prompts, recomputation after preemption).
        for request in continuing:
            if token_budget <= 0 or seq_budget <= 0 or running_budget <= 0:
                break
            if request.status is not _RUNNING:
                continue
            start = request.num_computed_tokens
            num_tokens = request.num_tokens
            n = min(num_tokens - start, token_budget)
            plan = None
            if images is not None and request.mm_features:
                n, plan = images.plan(request, start, n, self._enc_left)
                if not n:
                    continue  # its next image does not fit this step's encoder budget
            ends = start + n == num_tokens
            propose = self._num_to_propose(request, start, n) if speculate and ends else 0
            need = n + (propose if self._lookahead else 0)
            tables = allocate(request, need)
            if tables is None:
                tables, tokens_back, seqs_back = self._preempt_until_fits(
                    request, need, entries, preempted
                )
                token_budget += tokens_back
                seq_budget += seqs_back
                if tables is None:
                    continue
            if plan is not None:
                self._commit_images(request, plan)
            entry = ScheduledRequest(
                request, start, n, tables, ends and request.pooling_params is None
            )
            entry.num_to_propose = propose
            prefills.append(entry)
            token_budget -= n
            seq_budget -= 1
            running_budget -= 1

        # 3. New (or preempted) waiting requests, unless this step had to preempt.
        if not preempted and self.waiting:
            token_budget, seq_budget = self._admit_waiting(
                token_budget, seq_budget, decodes, prefills, speculate
            )

        decodes.extend(verifies)
        decodes.extend(prefills)
        if self.async_output:
            self._advance(decodes)
        out = SchedulerOutput(
            scheduled=decodes,
            num_batched_tokens=self._max_tokens - token_budget,
            blocks_to_copy=self.kv.take_copies(),
            preempted_ids=preempted,
        )
        if images is not None:
            out.free_encoder_hashes = images.end_step()
            out.scheduled_encoder_inputs = self._step_encodes
        return out

    def _commit_images(self, request: Request, plan: EncoderPlan) -> None:
        """Acquire the images a scheduled chunk reaches; charge the misses to the step."""
        if not plan.items:
            return
        to_encode = self.encoder_cache.commit(request, plan)
        self._enc_left -= plan.cost
        if to_encode:
            self._step_encodes.setdefault(request.request_id, []).extend(to_encode)

    @staticmethod
    def _advance(scheduled: list[ScheduledRequest]) -> None:
        """Asynchronous scheduling: account for a step when it is scheduled, with a
        placeholder for each token it will sample."""
        for entry in scheduled:
            if entry.spec_token_ids:
                continue  # a verification is accounted when its accepted length is known
            request = entry.request
            request.num_computed_tokens = entry.start + entry.num_new_tokens
            if entry.samples:
                entry.output_index = len(request.output_token_ids)
                request.output_token_ids.append(PLACEHOLDER_TOKEN)
                request.num_output_placeholders += 1

    def update_from_output(self, sched_out: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """Account for a finished step: advance ``num_computed_tokens``, append the sampled
        tokens of requests whose entry ``samples``, and offer newly full blocks to the prefix
        cache. Requests finished since ``schedule()`` are skipped.

        With asynchronous scheduling the step was accounted for when it was scheduled: the
        first sampled token replaces the entry's placeholder (a request preempted meanwhile
        still gets it: it resumes by recomputing its tokens)."""
        if self.async_output:
            self._fill_placeholders(sched_out, sampled)
        else:
            self._update_synchronously(sched_out, sampled)
        if self.encoder_cache is not None:
            # Images whose placeholders are all computed are released (they stay cached).
            for entry in sched_out.scheduled:
                self.encoder_cache.release_computed(entry.request)

    def _update_synchronously(
        self, sched_out: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> None:
        kv = self.kv
        caching = kv.enable_prefix_caching
        bs = self.block_size
        for entry in sched_out.scheduled:
            request = entry.request
            if request.status is not _RUNNING:
                continue
            start = entry.start
            computed = start + entry.num_new_tokens
            if entry.samples:
                tokens = sampled.get(request.request_id)
                if tokens:
                    if entry.spec_token_ids:
                        computed = self._accept(entry, tokens)
                    request.output_token_ids.extend(tokens)
            request.num_computed_tokens = computed
            if entry.spec_token_ids or (self._lookahead and entry.num_to_propose):
                kv.trim(request)  # rejected drafts' and look-ahead slots go back
            # A block can only have filled up if the step crossed a block boundary.
            if caching and computed // bs > start // bs:
                kv.cache_full_blocks(request)

    def _accept(self, entry: ScheduledRequest, tokens: list[int]) -> int:
        """Count a verification's accepted drafts (``tokens`` are the accepted prefix plus
        the target's own token) and return the request's computed tokens after it."""
        num_drafts = len(entry.spec_token_ids)
        accepted = len(tokens) - 1
        if not 0 <= accepted <= num_drafts:
            raise RuntimeError(
                f"request {entry.request.request_id!r} verified {num_drafts} draft tokens "
                f"but the step returned {len(tokens)} tokens"
            )
        if self.spec_stats is not None:
            self.spec_stats.observe(num_drafts, accepted)
        return entry.start + entry.num_new_tokens - num_drafts + accepted

    def _num_to_propose(self, request: Request, start: int, num_new: int) -> int:
        """How many drafts to propose after a step that computes ``num_new`` tokens from
        ``start`` and samples: no more than the next step could verify within
        ``max_tokens`` (counting one new token now and the target's own token then), and,
        when the proposer writes KV for them, no position past ``max_model_len``."""
        room = request.max_tokens - request.num_output_tokens - 2
        if self._lookahead:
            room = min(room, self.max_model_len - start - num_new)
        return max(0, min(self._spec_k, room))

    def _fill_placeholders(self, sched_out: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        kv = self.kv
        caching = kv.enable_prefix_caching
        for entry in sched_out.scheduled:
            request = entry.request
            if request.status.is_finished:
                continue
            if entry.spec_token_ids:
                # Verifications were not advanced when scheduled; account them now, as the
                # synchronous path does (nothing was scheduled after them).
                tokens = sampled.get(request.request_id)
                if request.status is _RUNNING and tokens:
                    request.num_computed_tokens = self._accept(entry, tokens)
                    request.output_token_ids.extend(tokens)
                    kv.trim(request)
                    if caching:
                        kv.cache_full_blocks(request)
                continue
            if self._lookahead and entry.num_to_propose and request.status is _RUNNING:
                kv.trim(request)
            if entry.samples:
                tokens = sampled.get(request.request_id)
                if not tokens:
                    raise RuntimeError(
                        f"step output has no token for request {request.request_id!r}, "
                        "which sampled in it"
                    )
                request.output_token_ids[entry.output_index] = tokens[0]
                request.num_output_placeholders -= 1
            # Every token before num_computed_tokens is known now (the only placeholder left
            # is the one the next step samples), so full blocks can be hashed.
            if caching and request.status is _RUNNING:
                kv.cache_full_blocks(request)

    # ------------------------------------------------------------------ stats
    def stats(self) -> SchedulerStats:
        """Counters and gauges (O(number of requests))."""
        kv = self.kv
        wasted, allocated = kv.waste_slots()
        queries, hits = kv.prefix_queries, kv.prefix_hits
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_total_blocks=kv.num_usable_blocks,
            num_used_blocks=kv.num_used_blocks,
            num_free_blocks=kv.num_free_blocks,
            kv_usage=kv.usage,
            kv_waste=wasted / allocated if allocated else 0.0,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            prefix_cache_hit_rate=hits / queries if queries else 0.0,
            num_preemptions=self.num_preemptions,
            num_rejected=self.num_rejected,
            spec_decoding=self.spec_stats.copy() if self.spec_stats is not None else None,
            encoder_cache_queries=self.encoder_cache.num_queries if self.encoder_cache else 0,
            encoder_cache_hits=self.encoder_cache.num_hits if self.encoder_cache else 0,
        )

    # ------------------------------------------------------------------ helpers
    def _admit_waiting(
        self,
        token_budget: int,
        seq_budget: int,
        decodes: list[ScheduledRequest],
        prefills: list[ScheduledRequest],
        speculate: bool = False,
    ) -> tuple[int, int]:
        kv = self.kv
        waiting = self.waiting
        lora = self.lora
        held: list[Request] = []  # held back by the LoRA limit, put back in order below
        while waiting and token_budget > 0 and seq_budget > 0:
            if len(self.running) >= self._max_seqs:
                break
            request = waiting.peek()
            assert request is not None
            if request.num_output_placeholders and self._pp > 1:
                # Preempted while its token was in flight: its recomputation needs that token
                # on the host first (a micro-batch in flight cannot feed it back).
                break
            if lora is not None and request.lora_id and (held or not lora.fits(request)):
                if len(held) >= self._max_seqs:
                    break  # a bounded look past held-back requests for ones without adapter
                held.append(waiting.pop())
                continue
            if request.request_id in self._no_prefix_hit:
                num_hit, hit_tables = 0, None
            else:
                num_hit, hit_tables = kv.get_computed_blocks(request)
            num_tokens = request.num_tokens
            n = num_tokens - num_hit
            whole = request.pooling_params is not None or (
                not self._chunked and request.num_preemptions == 0
            )
            if n > token_budget:
                # Without chunked prefill a fresh prompt runs whole; a preempted request
                # resumes in chunks all the same (its outputs may exceed any one step). A
                # pooling request always runs whole.
                if whole:
                    break
                n = token_budget
            plan = None
            if self.encoder_cache is not None and request.mm_features:
                wanted = n
                n, plan = self.encoder_cache.plan(request, num_hit, n, self._enc_left)
                if not n or (n < wanted and whole):
                    break  # its images do not fit this step's encoder budget or cache
            lookup = request.request_id not in self._no_prefix_hit
            ends = num_hit + n == num_tokens
            propose = self._num_to_propose(request, num_hit, n) if speculate and ends else 0
            need = n + (propose if self._lookahead else 0)
            if not kv.admit(request, num_hit, hit_tables, need, count_query=lookup):
                break  # head-of-line: later requests wait for blocks too
            waiting.pop()
            if plan is not None:
                self._commit_images(request, plan)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit
            request.status = _RUNNING
            request.num_computed_tokens = num_hit
            self.running.append(request)
            if lora is not None:
                lora.started(request)
            self._running_sorted = False
            entry = ScheduledRequest(
                request,
                num_hit,
                n,
                kv.block_tables(request.request_id),
                ends and request.pooling_params is None,
            )
            entry.num_to_propose = propose
            if entry.is_decode:
                decodes.append(entry)
            else:
                prefills.append(entry)
            token_budget -= n
            seq_budget -= 1
        for request in reversed(held):
            waiting.push(request, self._seq[request.request_id], front=True)
        return token_budget, seq_budget

    def _preempt_until_fits(
        self,
        request: Request,
        num_new_tokens: int,
        entries: tuple[list[ScheduledRequest], ...],
        preempted: list[str],
    ) -> tuple[list[list[int]] | None, int, int]:
        """Preempt victims until ``request`` gets its slots. Returns its tables (None if it
        was the victim itself) and the tokens and sequences handed back to the step's budgets
        by victims that were already scheduled in this step."""
        tokens_back = seqs_back = 0
        while True:
            victim = max(self.running, key=self._victim_key)
            for scheduled in entries:
                for i, entry in enumerate(scheduled):
                    if entry.request is victim:
                        del scheduled[i]
                        tokens_back += entry.num_new_tokens
                        seqs_back += 1
                        break
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return None, tokens_back, seqs_back
            tables = self.kv.allocate_slots(request, num_new_tokens)
            if tables is not None:
                return tables, tokens_back, seqs_back

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        if self.lora is not None:
            self.lora.stopped(request)
        self.kv.free(request.request_id)
        if self.encoder_cache is not None:
            self.encoder_cache.release_all(request.request_id)
            self._step_encodes.pop(request.request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []  # proposed for KV it no longer holds
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request, self._seq[request.request_id], front=True)

    def _priority_key(self, request: Request) -> tuple[int, float, int]:
        return (request.priority, request.arrival_time, self._seq[request.request_id])

    def _victim_key(self, request: Request) -> tuple:
        """The largest key is preempted first: lowest priority, then latest arrival."""
        if self._by_priority:
            return self._priority_key(request)
        return (request.arrival_time, self._seq[request.request_id])

    def _rejection_reason(self, request: Request) -> str | None:
        rid = request.request_id
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            return f"request {rid!r} has an empty prompt"
        if request.max_tokens < 0:
            return f"request {rid!r} has max_tokens={request.max_tokens} < 0"
        total = max(request.max_total_tokens, request.num_tokens)
        if total > self.max_model_len:
            return (
                f"request {rid!r} needs {num_prompt} prompt tokens + max_tokens="
                f"{request.max_tokens} = {total} tokens, more than max_model_len="
                f"{self.max_model_len}"
            )
        if not self._chunked and num_prompt > self._max_tokens:
            return (
                f"request {rid!r} has a prompt of {num_prompt} tokens but chunked prefill is "
                f"off and max_num_batched_tokens={self._max_tokens}"
            )
        if request.pooling_params is not None and num_prompt > self._max_tokens:
            return (
                f"request {rid!r} has a prompt of {num_prompt} tokens but a pooling request "
                f"runs whole in one step and max_num_batched_tokens={self._max_tokens}"
            )
        if request.mm_features and self.encoder_cache is not None:
            reason = self.encoder_cache.rejection_reason(request, self._max_tokens)
            if reason is not None:
                return reason
        elif request.mm_features:
            return f"request {rid!r} has images but this engine takes no image inputs"
        # A proposer that writes KV for its drafts may reach num_lookahead slots further.
        need = self.kv.max_blocks_needed(
            min(total + self._lookahead, self.max_model_len), self._max_tokens
        )
        usable = self.kv.num_usable_blocks
        if need > usable:
            return (
                f"request {rid!r} may need {need} KV-cache blocks of {self.block_size} tokens "
                f"for {total} tokens, but the cache has only {usable} usable blocks"
            )
        return None
