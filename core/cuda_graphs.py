"""CUDA-graph capture and replay of decode steps.

A decode step of a small model is a few hundred short kernels; launched one by one from Python
the GPU waits on the CPU. ``DecodeGraphs`` records the model's forward once per bucketed batch
size (1, 2, 4, 8, then multiples of 8 up to ``max_num_seqs``, at most 512) into CUDA graphs that
share one memory pool, and replays the smallest graph that holds the batch.

Everything a replay reads lives in static device buffers that the graphs were recorded with:
token ids, positions, and per KV-cache group the sequence lengths, block tables and slot
mapping. A step fills pinned host buffers, copies them asynchronously into the static buffers
and replays; padded batch entries get sequence length 0 and slot -1, so they neither read nor
write the cache. With asynchronous scheduling a request's input token may not be on the host
yet: its entry in the static "feedback" buffer then names the row of the previous step's
samples (the runner's feedback tensor) that holds it, and the graph itself gathers it, so the
step costs no extra launch. The captured attention metadata carries only the padded batch size
and ``max_seq_len = max_model_len`` as Python numbers, so only backends that read lengths from
the tensors may be captured: they declare ``supports_decode_graphs = True``.

**Cascade attention.** Where the attention backend runs it (``supports_cascade_attention``)
a second, coarser set of decode graphs (``cascade_sizes``) is captured with
``AttentionMetadata.cascade`` pointing at two more static buffers: each request's start after
the shared prefix, and the prefix's length and block-table row. A step whose decodes share a
prefix (``run(..., shared_prefix=...)``) fills them and replays the cascade graph that holds
it, so one graph serves every prefix length.

Used by ``ModelRunner`` when the platform's ``decode_graphs_class()`` names it (platforms that
``supports_graph_capture`` on a CUDA device) and ``EngineConfig.enforce_eager`` is off
(``--enforce-eager``). A platform may name a subclass that replays steps its own way: the CPU's
native plans (``engine_cpu.plan``) override ``_execute``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.attention_backends.interface import AttentionMetadata, CascadeInputs, SharedPrefix
from engine.request import PLACEHOLDER_TOKEN

if TYPE_CHECKING:
    from engine.scheduler_output import ScheduledRequest

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_num_seqs: int, limit: int = MAX_GRAPH_BATCH) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, 16, 24, 32, ... up to ``max_num_seqs`` (capped
    at ``limit``), always ending at that cap so every decode batch up to it has a graph."""
    top = max(1, min(max_num_seqs, limit))
    sizes = [s for s in (1, 2, 4, 8) if s < top]
    sizes += list(range(16, top, 8))
    sizes.append(top)
    return sorted(set(sizes))


def cascade_batch_sizes(sizes: list[int], min_batch: int = 1) -> list[int]:
    """The batch sizes captured with cascade attention: 8, 16, 24, 32, then steps of about
    1.5x (48, 64, 96, 128, ...) among the decode graph ``sizes``, and their largest, so a
    cascade step pads its batch by at most half (cascade pays only for many decodes, and each
    size is one more graph to capture); none smaller than ``min_batch``."""
    top = sizes[-1]
    coarse, power = [8, 16, 24], 32
    while power < top:
        coarse += [power, power * 3 // 2]
        power *= 2
    picked = sorted(s for s in {*coarse, top} if s in sizes and s >= 8)
    first = next((i for i, s in enumerate(picked) if s >= min_batch), len(picked))
    return picked[first:]


def feedback_row(feedback_rows: dict[str, int] | None, request_id: str) -> int:
    """The row of the previous step's samples that holds a request's placeholder input
    (asynchronous scheduling); a request that did not sample in that step is an error."""
    row = None if feedback_rows is None else feedback_rows.get(request_id)
    if row is None:
        raise RuntimeError(f"request {request_id!r} feeds a token the previous step did not sample")
    return row


def gather_feedback(
    ids: torch.Tensor, sources: torch.Tensor, feedback: torch.Tensor
) -> torch.Tensor:
    """``ids`` with every entry whose source is a row (>= 0) of ``feedback`` (the previous
    step's samples) replaced by that sample; -1 keeps the host's token. One device op, so a
    captured graph can run it too."""
    return torch.where(sources >= 0, feedback[sources.clamp(min=0)], ids)


def last_token(request: Any, start: int) -> int:
    """``request.all_token_ids[start]`` without building the concatenated list."""
    prompt = request.prompt_token_ids
    return prompt[start] if start < len(prompt) else request.output_token_ids[start - len(prompt)]


class DecodeGraphs:
    """Captured decode graphs for one model and KV cache.

    ``capture()`` records them (after the KV cache is allocated); ``run(scheduled)`` replays
    one for a batch of single-token requests and returns the hidden states ``[B, hidden]``, or
    None when the batch does not qualify (a prefill in it, or more requests than captured).

    With ``query_len = Q > 1`` the graphs hold ``Q`` query tokens per request (speculative
    verification: a decode and its ``Q - 1`` drafts), attended through the backend's varlen
    path; a request with fewer drafts is padded with tokens that write no KV (slot -1) and
    whose outputs are ignored, so one graph per batch size serves every mix of draft counts.
    ``run`` then returns ``[B * Q, hidden]``, request ``i``'s tokens at rows ``i * Q ..``.

    ``eager=True`` (tests) runs the same static-buffer computation without recording graphs,
    on any device, so the buffer layout is checked where no GPU is.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_groups: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        device: torch.device,
        feedback: torch.Tensor,
        query_len: int = 1,
        eager: bool = False,
        extra: Any = None,
        capture_error_mode: str = "global",
        cascade_group: int | None = None,
        cascade_min_batch: int = 1,
    ) -> None:
        """``capture_error_mode`` is ``torch.cuda.graph``'s: ``"thread_local"`` when the
        captured forward runs collectives (tensor parallelism), so that the process group's
        watchdog thread may keep querying its CUDA events while a graph is being captured.
        ``cascade_group`` names the KV-cache group (a full-attention one) whose layers run
        cascade attention in the cascade graphs; None captures none. No cascade graph is
        captured for fewer than ``cascade_min_batch`` requests (the backend's
        ``cascade_min_decodes``)."""
        self.model = model
        # Called right after the model in the captured computation: a tensor it produced on
        # the side (the target layers' hidden states an EAGLE-3 head reads), kept per graph.
        self.extra = extra
        self.capture_error_mode = capture_error_mode
        self.feedback = feedback
        self.num_groups = num_groups
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.query_len = q = query_len
        self.eager = eager
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.cascade_group = cascade_group if query_len == 1 else None
        self.cascade_sizes = (
            cascade_batch_sizes(self.sizes, cascade_min_batch)
            if self.cascade_group is not None
            else []
        )
        # Padded query tokens may look up to q - 1 positions past a table's last block.
        self.max_blocks = -(-max_model_len // block_size) + (-(-q // block_size) if q > 1 else 0)
        b, g, w = self.max_batch, num_groups, self.max_blocks
        t = b * q  # token rows
        self.max_tokens = t
        pin = not eager
        # Static device inputs. The int64 ones (ids, positions, feedback rows, slots) share one
        # buffer and the sequence lengths another, laid out exactly like their pinned host
        # twins, so each step is one host-to-device copy per buffer; block tables go through a
        # staging copy of only the columns in use.
        self._i64 = torch.zeros((3 + g) * t, dtype=torch.int64, device=device)
        # The sequence lengths of each group, then (cascade graphs) each request's start after
        # the shared prefix and the prefix's (length, block-table row).
        self._seq = torch.zeros(g * b + b + 2, dtype=torch.int32, device=device)
        self._tables = torch.zeros((g, b, w), dtype=torch.int32, device=device)
        self._table_stage = torch.zeros(g * b * w, dtype=torch.int32, device=device)
        self._qsl = torch.arange(b + 1, dtype=torch.int32, device=device) * q
        self._host_i64 = torch.zeros((3 + g) * t, dtype=torch.int64, pin_memory=pin)
        self._host_seq = torch.zeros(g * b + b + 2, dtype=torch.int32, pin_memory=pin)
        self._host_tables = torch.zeros(g * b * w, dtype=torch.int32, pin_memory=pin)
        self._np_i64 = self._host_i64.numpy()
        self._np_seq = self._host_seq.numpy()
        self._np_tables = self._host_tables.numpy()
        # The host buffers are free again once it fires.
        self._copied = None if eager else torch.cuda.Event()
        # Keyed by (batch size, cascade).
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self._input_ids: dict[tuple[int, bool], torch.Tensor] = {}  # the ids it ran (fed back)
        self._extras: dict[tuple[int, bool], torch.Tensor] = {}
        self._last_extra: torch.Tensor | None = None
        self._pool = None
        self._captured = False

    # ---- static views -----------------------------------------------------------------------
    def _ids(self, n: int) -> torch.Tensor:
        return self._i64[:n]

    def _positions(self, n: int) -> torch.Tensor:
        return self._i64[self.max_tokens : self.max_tokens + n]

    def _sources(self, n: int) -> torch.Tensor:
        return self._i64[2 * self.max_tokens : 2 * self.max_tokens + n]

    def _forward(
        self, n: int, cascade: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The captured computation for ``n`` requests: feed back in-flight tokens, then the
        model. Returns the hidden states, the input ids it ran and the ``extra`` output."""
        tokens = n * self.query_len
        ids = gather_feedback(self._ids(tokens), self._sources(tokens), self.feedback)
        hidden = self.model(ids, self._positions(tokens), self._metadata(n, cascade))
        return hidden, ids, self.extra() if self.extra is not None else None

    def _cascade_inputs(self, n: int) -> CascadeInputs:
        base = self.num_groups * self.max_batch
        return CascadeInputs(
            starts=self._seq[base : base + n],
            prefix=self._seq[base + self.max_batch : base + self.max_batch + 2],
        )

    def _metadata(self, n: int, cascade: bool = False) -> list[AttentionMetadata]:
        b, t, q = self.max_batch, self.max_tokens, self.query_len
        out = []
        for g in range(self.num_groups):
            slots = self._i64[(3 + g) * t : (3 + g) * t + n * q]
            out.append(
                AttentionMetadata(
                    num_actual_tokens=n * q,
                    num_seqs=n,
                    num_decodes=n if q == 1 else 0,
                    max_query_len=q,
                    max_seq_len=self.max_model_len,
                    block_size=self.block_size,
                    query_start_loc=self._qsl[: n + 1],
                    seq_lens=self._seq[g * b : g * b + n],
                    block_table=self._tables[g, :n],
                    slot_mapping=slots,
                    cascade=(
                        self._cascade_inputs(n) if cascade and g == self.cascade_group else None
                    ),
                )
            )
        return out

    # ---- capture ----------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> float:
        """Record one graph per batch size, largest first so smaller ones reuse its pool.
        Returns the seconds it took."""
        start = time.perf_counter()
        b = self.max_batch
        # Padding everywhere: no cache reads (length 0), no cache writes (slot -1), no
        # feedback (-1).
        self._i64.zero_()
        self._i64[2 * self.max_tokens :] = -1
        self._seq.zero_()
        self._captured = True
        if self.eager:
            return 0.0
        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # The plain graphs, then the cascade ones; a cascade graph captured with no prefix
        # (length 0, every start 0) attends as usual until a replay fills its buffers.
        keys = [(n, False) for n in reversed(self.sizes)]
        keys += [(n, True) for n in reversed(self.cascade_sizes)]
        with torch.cuda.stream(stream):
            for key in keys:
                self._forward(*key)  # warm-up: Triton compiles outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(
                    graph,
                    pool=self._pool,
                    stream=stream,
                    capture_error_mode=self.capture_error_mode,
                ):
                    self._outputs[key], self._input_ids[key], extra = self._forward(*key)
                if extra is not None:
                    self._extras[key] = extra
                self._graphs[key] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        what = "decode" if self.query_len == 1 else f"verify ({self.query_len} tokens/request)"
        cascade = f" and {len(self.cascade_sizes)} with cascade attention" * bool(
            self.cascade_sizes
        )
        logger.info(
            "captured %d %s graphs (batch 1..%d)%s in %.1f s",
            len(self.sizes),
            what,
            b,
            cascade,
            seconds,
        )
        return seconds

    # ---- replay -----------------------------------------------------------------------------
    def padded_size(self, num_seqs: int, cascade: bool = False) -> int | None:
        """The captured size (of the cascade graphs with ``cascade``) that holds ``num_seqs``
        requests (None: too many)."""
        if num_seqs > self.max_batch or not self._captured:
            return None
        for n in self.cascade_sizes if cascade else self.sizes:
            if n >= num_seqs:
                return n
        return None

    def takes_cascade(self, num_seqs: int) -> bool:
        """Whether a cascade graph holds a decode batch of ``num_seqs`` requests."""
        return self.padded_size(num_seqs, cascade=True) is not None

    def qualifies(self, scheduled: list[ScheduledRequest]) -> bool:
        """Whether a graph holds this batch: one-token decodes (``query_len`` 1), or decodes
        and verifications of at most ``query_len`` tokens."""
        if self.padded_size(len(scheduled)) is None:
            return False
        if self.query_len == 1:
            return all(s.num_new_tokens == 1 for s in scheduled)
        q = self.query_len
        return all(s.num_known_tokens == 1 and s.num_new_tokens <= q for s in scheduled)

    def last_input_ids(self, num: int) -> torch.Tensor:
        """The input ids the last ``run`` fed (placeholders resolved), ``[num * query_len]``."""
        return self._last_ids[: num * self.query_len]

    def last_extra(self, num: int) -> torch.Tensor | None:
        """The ``extra`` output of the last ``run``, ``[num * query_len, ...]``."""
        if self._last_extra is None:
            return None
        return self._last_extra[: num * self.query_len]

    def run(
        self,
        scheduled: list[ScheduledRequest],
        feedback_rows: dict[str, int] | None = None,
        shared_prefix: SharedPrefix | None = None,
    ) -> torch.Tensor | None:
        """Replay the graph for a qualifying batch; hidden states ``[B * query_len, hidden]``
        (a view of the graph's static output, valid until the next replay).
        ``feedback_rows`` maps request ids to their row in the feedback tensor, for inputs
        that are still placeholders; ``shared_prefix`` (of group ``cascade_group``'s tables)
        replays a cascade graph, which must hold the batch (``takes_cascade``)."""
        if not self.qualifies(scheduled):
            return None
        num, q = len(scheduled), self.query_len
        tokens = np.zeros((num, q), dtype=np.int64)
        firsts = [last_token(s.request, s.start) for s in scheduled]
        tokens[:, 0] = firsts
        if q > 1:
            for i, s in enumerate(scheduled):
                if s.spec_token_ids:
                    tokens[i, 1 : 1 + len(s.spec_token_ids)] = s.spec_token_ids
        sources = None
        if PLACEHOLDER_TOKEN in firsts:
            sources = np.full((num, q), -1, dtype=np.int64)
            for i, token in enumerate(firsts):
                if token == PLACEHOLDER_TOKEN:
                    sources[i, 0] = feedback_row(feedback_rows, scheduled[i].request.request_id)
        return self.replay(
            [s.start for s in scheduled],
            [s.num_new_tokens for s in scheduled],
            [s.block_ids for s in scheduled],
            tokens,
            sources,
            shared_prefix,
        )

    def replay(
        self,
        starts: list[int],
        counts: list[int],
        block_ids: list[list[list[int]]],
        tokens: np.ndarray,
        sources: np.ndarray | None = None,
        shared_prefix: SharedPrefix | None = None,
    ) -> torch.Tensor | None:
        """Replay for ``len(starts)`` requests given as arrays: request ``i`` has
        ``counts[i] <= query_len`` tokens from position ``starts[i]``, ``tokens[i, :count]``
        (``[num, query_len]``), unless ``sources[i, t] >= 0`` names the row of the feedback
        tensor that holds it; ``block_ids[i][g]`` is its table of group ``g``; with
        ``shared_prefix`` through a cascade graph. None when the batch is too large."""
        num = len(starts)
        cascade = shared_prefix is not None
        if cascade and not self.cascade_sizes:
            raise ValueError("these decode graphs were captured without cascade attention")
        n = self.padded_size(num, cascade)
        if n is None:
            return None
        q = self.query_len
        b, t, bs, g_count = self.max_batch, self.max_tokens, self.block_size, self.num_groups
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the host buffers
        i64, seq, tables = self._np_i64, self._np_seq, self._np_tables
        starts_np = np.asarray(starts, dtype=np.int64)
        ids = i64[: n * q].reshape(n, q)
        pos = i64[t : t + n * q].reshape(n, q)
        src = i64[2 * t : 2 * t + n * q].reshape(n, q)
        ids[:num] = tokens
        ids[num:] = 0
        if sources is None:
            src[:] = -1
        else:
            src[:num] = sources
            src[num:] = -1
        if q == 1:
            pos[:num, 0] = starts_np
        else:
            # Padded tokens sit after the real ones; clamped to the rotary table.
            pos[:num] = np.minimum(starts_np[:, None] + np.arange(q), self.max_model_len - 1)
        pos[num:] = 0
        width = 1
        for g in range(g_count):
            lists = [blocks[g] for blocks in block_ids]
            width = max(width, max(len(tb) for tb in lists))
            # A request's context ends with its q query tokens (real or padded), so that the
            # varlen path puts its first query at position ``start``.
            seq[g * b : g * b + num] = starts_np + q
            seq[g * b + num : g * b + n] = 0
            base = (3 + g) * t
            if q == 1:
                slot_block = [tb[p // bs] for tb, p in zip(lists, starts, strict=True)]
                i64[base : base + num] = (
                    np.asarray(slot_block, dtype=np.int64) * bs + starts_np % bs
                )
                i64[base + num : base + n] = -1
                continue
            slots = i64[base : base + n * q].reshape(n, q)
            slots[:] = -1
            for i, (tb, p, c) in enumerate(zip(lists, starts, counts, strict=True)):
                slots[i, :c] = [tb[(p + j) // bs] * bs + (p + j) % bs for j in range(c)]
        if cascade:  # the buffers _cascade_inputs views
            base = g_count * b
            shared_prefix.write(seq[base : base + n], seq[base + b : base + b + 2])
        # Block tables, packed [group, request, width] with only the columns in use.
        stage = tables[: g_count * num * width].reshape(g_count, num, width)
        for g in range(g_count):
            for i, blocks in enumerate(block_ids):
                tb = blocks[g]
                stage[g, i, : len(tb)] = tb
        self._i64.copy_(self._host_i64, non_blocking=True)
        self._seq.copy_(self._host_seq, non_blocking=True)
        count = g_count * num * width
        self._table_stage[:count].copy_(self._host_tables[:count], non_blocking=True)
        self._tables[:, :num, :width].copy_(self._table_stage[:count].view(g_count, num, width))
        return self._execute(n, cascade)[: num * q]

    def _execute(self, n: int, cascade: bool) -> torch.Tensor:
        """Run the step for ``n`` (padded) requests on the filled static buffers: replay its
        graph, or run the forward (``eager``). Returns the static output; sets the ids and
        ``extra`` that ``last_input_ids`` and ``last_extra`` return."""
        if self.eager:
            with torch.inference_mode():
                hidden, self._last_ids, self._last_extra = self._forward(n, cascade)
            return hidden
        self._copied.record()
        key = (n, cascade)
        self._graphs[key].replay()
        self._last_ids = self._input_ids[key]
        self._last_extra = self._extras.get(key)
        return self._outputs[key]
