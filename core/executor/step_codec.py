"""The per-step message from the engine to its workers: only what changed since the last step.

Pickling a ``SchedulerOutput`` would copy every scheduled request whole (all its tokens, its
block tables, its sampling parameters) into every step. Instead the workers keep a mirror of
each live request and the engine sends, per step, msgspec-encoded:

* a new request's prompt, once; then per scheduled request the tokens the workers do not have
  yet (a decode sends one; a token still being sampled is sent as ``PLACEHOLDER_TOKEN`` and
  sent again once known), so a worker's mirror of a request is the engine's;
* block tables as deltas: the entries from the first one the workers may hold differently
  (new blocks at the end, a copy-on-write replacement of the block being written);
* sampling parameters once per request (pickled, they are rare), generators as handles
  (created on the worker from the engine-side generator's seed, freed when the engine drops
  it), structured-output bitmasks as bytes;
* the requests that finished, so the workers drop their mirrors after running the step.

``StepEncoder`` runs in the engine process, ``StepDecoder`` in every worker; the decoder
rebuilds the ``SchedulerOutput`` and ``SamplingRow``s the ``ModelRunner`` takes, so the runner
is the same in a worker as in the engine process.
"""

from __future__ import annotations

import pickle
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from engine.request import PLACEHOLDER_TOKEN, Request
from engine.scheduler_output import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    import torch


class NewRequest(msgspec.Struct, array_like=True):
    """A request the workers do not hold yet; ``mm_features`` is its images
    (``MultiModalFeature`` list, pickled: pixel arrays and placeholder ranges; empty: none);
    ``lora_id`` is the engine's key of its LoRA adapter (0: none), which every rank maps to its
    own slot of that adapter."""

    req_id: str
    prompt: list[int]
    mm_features: bytes = b""
    lora_id: int = 0


class Entry(msgspec.Struct, array_like=True, omit_defaults=True):
    """One scheduled request: ``tokens`` replace the worker's tokens from ``token_offset`` on
    (an offset into prompt + output); ``tables[g]`` replaces group ``g``'s table from
    ``table_offsets[g]`` on. Speculative decoding: ``spec_token_ids`` are the drafts the step
    verifies and ``num_to_propose`` how many to propose after it (trailing defaults, left out
    of the message when speculation is off)."""

    req_id: str
    start: int
    num_new_tokens: int
    samples: bool
    output_index: int
    token_offset: int
    tokens: list[int]
    table_offsets: list[int]
    tables: list[list[int]]
    spec_token_ids: list[int] = msgspec.field(default_factory=list)
    num_to_propose: int = 0


class Row(msgspec.Struct, array_like=True):
    """A sampling row: ``params`` is the pickled ``SamplingParams`` when the worker does not
    have this request's yet (else empty); ``generators`` are handles (-1: unseeded);
    ``output_len`` how many output tokens the row reads (penalties, ``min_tokens``);
    ``eos_token_ids`` when they differ from the previous row's (the engine passes one list);
    ``bitmask_rows`` the rows of a 2-D structured-output bitmask (one per verified position of
    a speculative step; 0: one row, 1-D)."""

    req_id: str
    params: bytes
    num_samples: int
    generators: list[int]
    output_len: int
    bitmask: bytes | None = None
    eos_token_ids: list[int] | None = None
    bitmask_rows: int = 0


class Step(msgspec.Struct, array_like=True):
    step_id: int
    num_batched_tokens: int
    new_requests: list[NewRequest]
    entries: list[Entry]
    rows: list[Row]
    prompt_logprobs: dict[str, int]
    blocks_to_copy: list[tuple[int, int]]
    new_generators: list[tuple[int, int]]  # (handle, seed)
    freed_generators: list[int]
    finished: list[str]  # dropped by the workers after this step ran
    # Image inputs: encoder-cache entries to drop before the step, images to encode in it.
    free_encoder_hashes: list[str] = msgspec.field(default_factory=list)
    encoder_inputs: dict[str, list[str]] = msgspec.field(default_factory=dict)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Step)


@dataclass
class _Sent:
    """What the workers hold of one request."""

    request: Request
    synced: int  # leading tokens (prompt + output) the workers have with their real values
    tables: list[Any]  # per group: the engine's live table object last sent (identity)
    copies: list[list[int]]  # per group: the entries the workers hold
    params: Any = None


class StepEncoder:
    """Engine side: turns each step into a ``Step`` message (bytes) against what the workers
    already hold.

    Block tables are diffed on the KV-cache manager's contract: a request's table is a new
    list whenever its earlier entries are rewritten (admission, resumption after preemption);
    otherwise entries are appended, replaced from the first block a step writes
    (copy-on-write after a fork), or, before that, freed by a sliding window (set to the null
    block; never read again, so the workers may keep the old id).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._sent: dict[str, _Sent] = {}
        self._step_id = 0
        self._handles: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._next_handle = 0
        # Handles of generators the engine dropped; filled by weakref finalizers, which may
        # run on any thread (deque appends and pops are atomic).
        self._freed: deque[int] = deque()
        self._eos: Any = None  # the engine's EOS list object last sent

    @property
    def num_live_requests(self) -> int:
        """Requests the workers hold a mirror of."""
        return len(self._sent)

    def encode(
        self,
        sched_out: SchedulerOutput,
        sampling_rows: dict[str, Any],
        prompt_logprobs: dict[str, int] | None = None,
    ) -> tuple[int, bytes]:
        """``(step_id, message)`` for this step."""
        self._step_id += 1
        sent = self._sent
        new_requests: list[NewRequest] = []
        entries: list[Entry] = []
        for sr in sched_out.scheduled:
            request = sr.request
            rid = request.request_id
            m = sent.get(rid)
            if m is None or m.request is not request:  # new (or an id reused after finishing)
                groups = len(sr.block_ids)
                m = _Sent(request, len(request.prompt_token_ids), [None] * groups, [[]] * groups)
                sent[rid] = m
                images = b""
                if request.mm_features:
                    images = pickle.dumps(request.mm_features, protocol=pickle.HIGHEST_PROTOCOL)
                new_requests.append(
                    NewRequest(rid, request.prompt_token_ids, images, request.lora_id)
                )
            entries.append(self._entry(sr, m))
        rows: list[Row] = []
        new_generators: list[tuple[int, int]] = []
        for rid, row in sampling_rows.items():
            m = sent[rid]
            params = b""
            if m.params is not row.params:
                params = pickle.dumps(row.params, protocol=pickle.HIGHEST_PROTOCOL)
                m.params = row.params
            handles = [self._handle(g, new_generators) for g in row.generators]
            bitmask, bitmask_rows = None, 0
            if row.token_bitmask is not None:
                bitmask = row.token_bitmask.numpy().tobytes()
                if row.token_bitmask.dim() == 2:
                    bitmask_rows = int(row.token_bitmask.shape[0])
            eos = None
            if row.eos_token_ids is not self._eos:
                self._eos = row.eos_token_ids
                eos = list(row.eos_token_ids)
            rows.append(
                Row(
                    rid,
                    params,
                    row.num_samples,
                    handles,
                    len(row.output_token_ids),
                    bitmask,
                    eos,
                    bitmask_rows,
                )
            )
        finished = [rid for rid, m in sent.items() if m.request.status.is_finished]
        for rid in finished:
            del sent[rid]
        freed = [self._freed.popleft() for _ in range(len(self._freed))]
        step = Step(
            step_id=self._step_id,
            num_batched_tokens=sched_out.num_batched_tokens,
            new_requests=new_requests,
            entries=entries,
            rows=rows,
            prompt_logprobs=dict(prompt_logprobs or {}),
            blocks_to_copy=[(int(a), int(b)) for a, b in sched_out.blocks_to_copy],
            new_generators=new_generators,
            freed_generators=freed,
            finished=finished,
            free_encoder_hashes=list(sched_out.free_encoder_hashes),
            encoder_inputs=dict(sched_out.scheduled_encoder_inputs),
        )
        return self._step_id, _ENCODER.encode(step)

    def _entry(self, sr: ScheduledRequest, m: _Sent) -> Entry:
        request = sr.request
        num_prompt = len(request.prompt_token_ids)
        offset = m.synced
        # Every token the engine has (so the mirror is the engine's request), each sent once;
        # usually the one sampled last.
        tokens = request.output_token_ids[offset - num_prompt :]
        m.synced = offset + len(tokens)
        if PLACEHOLDER_TOKEN in tokens:  # still on the device: send it again once known
            m.synced = offset + tokens.index(PLACEHOLDER_TOKEN)
        table_offsets, tables = [], []
        first_written = sr.start // self.block_size
        for g, table in enumerate(sr.block_ids):
            mine = m.copies[g]
            if m.tables[g] is not table:
                start = 0  # a new table (admission, resumption): all of it
                mine = m.copies[g] = []
                m.tables[g] = table
            else:
                n = len(mine)
                k = min(n, first_written)
                start = n if table[k:n] == mine[k:n] else k
            part = table[start:]
            del mine[start:]
            mine.extend(part)
            table_offsets.append(start)
            tables.append(part)
        return Entry(
            request.request_id,
            sr.start,
            sr.num_new_tokens,
            sr.samples,
            sr.output_index,
            offset,
            tokens,
            table_offsets,
            tables,
            list(sr.spec_token_ids),
            sr.num_to_propose,
        )

    def _handle(self, generator: Any, new: list[tuple[int, int]]) -> int:
        """The handle of an engine-side generator; a first use sends its seed (the workers
        create their own from it, so the engine's is never advanced)."""
        if generator is None:
            return -1
        handle = self._handles.get(generator)
        if handle is None:
            handle = self._next_handle
            self._next_handle += 1
            self._handles[generator] = handle
            weakref.finalize(generator, self._freed.append, handle)
            new.append((handle, int(generator.initial_seed())))
        return handle


@dataclass
class DecodedStep:
    """A step as the worker's ``ModelRunner`` takes it."""

    step_id: int
    sched_out: SchedulerOutput
    sampling_rows: dict[str, Any]
    prompt_logprobs: dict[str, int]
    finished: list[str] = field(default_factory=list)
    freed_generators: list[int] = field(default_factory=list)


class StepDecoder:
    """Worker side: the request mirrors, generators and parameters the messages refer to."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = device
        self.requests: dict[str, Request] = {}
        self.tables: dict[str, list[list[int]]] = {}
        self.params: dict[str, Any] = {}
        self.generators: dict[int, torch.Generator] = {}
        self.eos_token_ids: list[int] = []

    def decode(self, message: bytes | memoryview) -> DecodedStep:
        import torch

        from engine.sampler import SamplingRow

        step = _DECODER.decode(message)
        for new in step.new_requests:
            mirror = Request(new.req_id, list(new.prompt), max_tokens=0)
            if new.mm_features:
                mirror.mm_features = pickle.loads(new.mm_features)
            mirror.lora_id = new.lora_id
            self.requests[new.req_id] = mirror
            self.tables.pop(new.req_id, None)
        for handle, seed in step.new_generators:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self.generators[handle] = gen
        scheduled = []
        for e in step.entries:
            request = self.requests[e.req_id]
            if e.tokens:
                out = request.output_token_ids
                del out[e.token_offset - request.num_prompt_tokens :]
                out.extend(e.tokens)
            tables = self.tables.get(e.req_id)
            if tables is None:
                tables = self.tables[e.req_id] = [[] for _ in e.tables]
            for table, offset, part in zip(tables, e.table_offsets, e.tables, strict=True):
                table[offset:] = part
            scheduled.append(
                ScheduledRequest(
                    request,
                    e.start,
                    e.num_new_tokens,
                    tables,
                    e.samples,
                    e.output_index,
                    e.spec_token_ids,
                    e.num_to_propose,
                )
            )
        rows = {}
        for r in step.rows:
            if r.params:
                self.params[r.req_id] = pickle.loads(r.params)
            if r.eos_token_ids is not None:
                self.eos_token_ids = r.eos_token_ids
            request = self.requests[r.req_id]
            bitmask = None
            if r.bitmask is not None:
                bitmask = torch.frombuffer(bytearray(r.bitmask), dtype=torch.int32)
                if r.bitmask_rows:
                    bitmask = bitmask.view(r.bitmask_rows, -1)
            outputs = request.output_token_ids
            if r.output_len != len(outputs):  # penalties read the tokens before this step's
                outputs = outputs[: r.output_len]
            rows[r.req_id] = SamplingRow(
                params=self.params[r.req_id],
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=outputs,
                generators=[None if h < 0 else self.generators[h] for h in r.generators],
                num_samples=r.num_samples,
                eos_token_ids=self.eos_token_ids,
                token_bitmask=bitmask,
            )
        sched_out = SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=step.num_batched_tokens,
            blocks_to_copy=[tuple(p) for p in step.blocks_to_copy],
            free_encoder_hashes=step.free_encoder_hashes,
            scheduled_encoder_inputs=step.encoder_inputs,
        )
        return DecodedStep(
            step.step_id,
            sched_out,
            rows,
            step.prompt_logprobs,
            step.finished,
            step.freed_generators,
        )

    def after_step(self, step: DecodedStep) -> None:
        """Drop what the step's message said is finished (it ran first)."""
        for rid in step.finished:
            self.requests.pop(rid, None)
            self.tables.pop(rid, None)
            self.params.pop(rid, None)
        for handle in step.freed_generators:
            self.generators.pop(handle, None)
