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

Used by ``ModelRunner`` when the platform ``supports_graph_capture`` and
``EngineConfig.enforce_eager`` is off (``--enforce-eager``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.attention_backends.interface import AttentionMetadata
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
        capture_error_mode: str = "global",
    ) -> None:
        """``capture_error_mode`` is ``torch.cuda.graph``'s: ``"thread_local"`` when the
        captured forward runs collectives (tensor parallelism), so that the process group's
        watchdog thread may keep querying its CUDA events while a graph is being captured."""
        self.model = model
        self.capture_error_mode = capture_error_mode
        self.feedback = feedback
        self.num_groups = num_groups
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        b, g, w = self.max_batch, num_groups, self.max_blocks
        # Static device inputs. The int64 ones (ids, positions, feedback rows, slots) share one
        # buffer and the sequence lengths another, laid out exactly like their pinned host
        # twins, so each step is one host-to-device copy per buffer; block tables go through a
        # staging copy of only the columns in use.
        self._i64 = torch.zeros((3 + g) * b, dtype=torch.int64, device=device)
        self._seq = torch.zeros(g * b, dtype=torch.int32, device=device)
        self._tables = torch.zeros((g, b, w), dtype=torch.int32, device=device)
        self._table_stage = torch.zeros(g * b * w, dtype=torch.int32, device=device)
        self._qsl = torch.arange(b + 1, dtype=torch.int32, device=device)
        self._host_i64 = torch.zeros((3 + g) * b, dtype=torch.int64, pin_memory=True)
        self._host_seq = torch.zeros(g * b, dtype=torch.int32, pin_memory=True)
        self._host_tables = torch.zeros(g * b * w, dtype=torch.int32, pin_memory=True)
        self._np_i64 = self._host_i64.numpy()
        self._np_seq = self._host_seq.numpy()
        self._np_tables = self._host_tables.numpy()
        self._copied = torch.cuda.Event()  # the host buffers are free again once it fires
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool = None

    # ---- static views -----------------------------------------------------------------------
    def _ids(self, n: int) -> torch.Tensor:
        return self._i64[:n]

    def _positions(self, n: int) -> torch.Tensor:
        return self._i64[self.max_batch : self.max_batch + n]

    def _sources(self, n: int) -> torch.Tensor:
        return self._i64[2 * self.max_batch : 2 * self.max_batch + n]

    def _forward(self, n: int) -> torch.Tensor:
        """The captured computation: feed back in-flight tokens, then the model."""
        ids = gather_feedback(self._ids(n), self._sources(n), self.feedback)
        return self.model(ids, self._positions(n), self._metadata(n))

    def _metadata(self, n: int) -> list[AttentionMetadata]:
        b = self.max_batch
        out = []
        for g in range(self.num_groups):
            slots = self._i64[(3 + g) * b : (3 + g) * b + n]
            out.append(
                AttentionMetadata(
                    num_actual_tokens=n,
                    num_seqs=n,
                    num_decodes=n,
                    max_query_len=1,
                    max_seq_len=self.max_model_len,
                    block_size=self.block_size,
                    query_start_loc=self._qsl[: n + 1],
                    seq_lens=self._seq[g * b : g * b + n],
                    block_table=self._tables[g, :n],
                    slot_mapping=slots,
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
        self._i64[2 * b :] = -1
        self._seq.zero_()
        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for n in reversed(self.sizes):
                self._forward(n)  # warm-up: Triton compiles outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(
                    graph,
                    pool=self._pool,
                    stream=stream,
                    capture_error_mode=self.capture_error_mode,
                ):
                    self._outputs[n] = self._forward(n)
                self._graphs[n] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        logger.info(
            "captured %d decode graphs (batch 1..%d) in %.1f s", len(self.sizes), b, seconds
        )
        return seconds

    # ---- replay -----------------------------------------------------------------------------
    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size that holds ``num_seqs`` requests (None: too many)."""
        if num_seqs > self.max_batch or not self._graphs:
            return None
        for n in self.sizes:
            if n >= num_seqs:
                return n
        return None

    def run(
        self, scheduled: list[ScheduledRequest], feedback_rows: dict[str, int] | None = None
    ) -> torch.Tensor | None:
        """Replay the graph for a batch of one-token requests; hidden states ``[B, hidden]``
        (a view of the graph's static output, valid until the next replay).
        ``feedback_rows`` maps request ids to their row in the feedback tensor, for inputs
        that are still placeholders."""
        num = len(scheduled)
        n = self.padded_size(num)
        if n is None or any(s.num_new_tokens != 1 for s in scheduled):
            return None
        b, bs, g_count = self.max_batch, self.block_size, self.num_groups
        self._copied.synchronize()  # the previous step's copies have read the host buffers
        i64, seq, tables = self._np_i64, self._np_seq, self._np_tables
        starts = np.fromiter((s.start for s in scheduled), dtype=np.int64, count=num)
        tokens = [last_token(s.request, s.start) for s in scheduled]
        i64[:num] = tokens
        i64[num:n] = 0
        i64[b : b + num] = starts
        i64[b + num : b + n] = 0
        src = i64[2 * b : 2 * b + n]
        src[:] = -1
        if PLACEHOLDER_TOKEN in tokens:
            for i, token in enumerate(tokens):
                if token == PLACEHOLDER_TOKEN:
                    src[i] = feedback_row(feedback_rows, scheduled[i].request.request_id)
        width = 1
        for g in range(g_count):
            lists = [s.block_ids[g] for s in scheduled]
            width = max(width, max(len(t) for t in lists))
            seq[g * b : g * b + num] = starts + 1
            seq[g * b + num : g * b + n] = 0
            slot_block = [t[p // bs] for t, p in zip(lists, starts.tolist(), strict=True)]
            base = (3 + g) * b
            i64[base : base + num] = np.asarray(slot_block, dtype=np.int64) * bs + starts % bs
            i64[base + num : base + n] = -1
        # Block tables, packed [group, request, width] with only the columns in use.
        stage = tables[: g_count * num * width].reshape(g_count, num, width)
        for g in range(g_count):
            for i, s in enumerate(scheduled):
                t = s.block_ids[g]
                stage[g, i, : len(t)] = t
        self._i64.copy_(self._host_i64, non_blocking=True)
        self._seq.copy_(self._host_seq, non_blocking=True)
        count = g_count * num * width
        self._table_stage[:count].copy_(self._host_tables[:count], non_blocking=True)
        self._tables[:, :num, :width].copy_(self._table_stage[:count].view(g_count, num, width))
        self._copied.record()
        self._graphs[n].replay()
        return self._outputs[n][:num]
