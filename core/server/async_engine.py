"""The server's front end of the engine: requests in, streams of ``RequestOutput`` out.

``AsyncEngine`` runs in the event loop's thread. It sends each request to an engine core as
token ids through an asynchronous client (``engine.engine_core.async_client``): engine-core
processes over ZMQ (``AsyncMPClient``, what ``engine serve`` runs), or a core in a thread of
this process (``ThreadedCoreClient``, tests). The core's token-level outputs come back once per
step; the ``OutputProcessor`` detokenizes them, applies stop strings (and tells the core to stop
those sequences) and builds ``RequestOutput``s, which go to each HTTP request's
``OutputChannel`` (an unbounded deque plus a future to wake its reader, so a slow client never
blocks anything: its outputs queue up and the reader takes them all at once).

Streams get an output every ``stream_interval`` tokens (vLLM's ``--stream-interval``; 1: every
step); non-streaming requests only their final one.

A core that fails (an exception in a step, or its process dying) marks the engine dead: every
in-flight request fails with ``EngineDeadError`` (HTTP 500; in-band for a stream already
running), later requests fail at once, and ``/health`` answers 503. Nothing ever waits on a core
that is gone. A model worker process that dies (tensor/pipeline parallelism) is such a failure
of its core: the executor wakes the core's loop, idle or not, and the core reports it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from engine.engine_core.messages import EngineCoreRequest, EngineStats
from engine.errors import EngineDeadError
from engine.output_processor import FINAL_ONLY, OutputProcessor
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "EngineStoppedError", "OutputChannel"]


class EngineStoppedError(RuntimeError):
    """The engine was shut down (server draining ended) before the request finished (503)."""


class EngineObserver(Protocol):
    """Receives per-request timings and engine stats (metrics, logs), in the loop's thread.

    Every method must be quick and never raise.
    """

    def on_first_token(self, ttft_s: float) -> None: ...

    def on_inter_tokens(self, intervals: list[tuple[float, int]]) -> None:
        """``(seconds, count)`` pairs: ``count`` requests got a token ``seconds`` after their
        previous one."""

    def on_finished(self, e2e_s: float, finish_reasons: list[str | None]) -> None: ...

    def on_stats(self, stats: dict[int, EngineStats], now: float) -> None:
        """The latest stats of every engine core, by data-parallel rank."""


@dataclass
class EngineStatsSnapshot:
    """The engine cores' latest stats (summed over data-parallel ranks), the KV blocks in use
    and when they were taken (the cores' ``time.monotonic()``)."""

    stats: Any = None
    num_used_blocks: int = 0
    time: float = 0.0


class OutputChannel:
    """The stream of engine outputs for one HTTP request (one or more engine requests).

    Lives on the event loop. ``stream=False`` channels receive only final outputs.
    """

    def __init__(self, engine: AsyncEngine, stream: bool) -> None:
        self._engine = engine
        self.stream = stream
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.request_ids: list[str] = []
        self.unfinished: set[str] = set()
        self.closed = False

    def _push(self, item: Any) -> None:
        """Queue an output (a ``RequestOutput``) or an exception for the reader."""
        if self.closed:
            return
        if not isinstance(item, BaseException) and item.finished:
            self.unfinished.discard(item.request_id)
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> list[Any]:
        """Wait for at least one output and return every output queued so far, in order.

        Taking everything at once lets a slow reader coalesce several engine steps into one
        chunk. An exception delivered by the engine is raised here.
        """
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = list(self._items)
        self._items.clear()
        for item in items:
            if isinstance(item, BaseException):
                raise item
        return items

    async def collect_final(self) -> dict[str, Any]:
        """Wait until every request of this channel finished; return the final outputs by id."""
        finals: dict[str, Any] = {}
        while len(finals) < len(self.request_ids):
            for out in await self.get():
                if out.finished:
                    finals[out.request_id] = out
        return finals

    def abort(self) -> None:
        """Abort the unfinished engine requests of this channel and stop delivering to it."""
        if self.unfinished:
            self._engine.abort(list(self.unfinished))
            self.unfinished.clear()
        self.close()

    def close(self) -> None:
        """Stop delivering outputs (idempotent); the engine forgets the channel."""
        if not self.closed:
            self.closed = True
            self._engine._channels.discard(self)


class AsyncEngine:
    """The asyncio-facing engine of the server; see the module docstring.

    ``client`` is an asynchronous engine-core client, not started; ``start()`` starts it and
    returns once every core is ready. ``on_dead`` is called (in the loop) if a core fails.
    """

    def __init__(
        self,
        client: Any,
        *,
        observer: EngineObserver | None = None,
        stream_interval: int = 1,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.client = client
        self.observer = observer
        self.stream_interval = stream_interval
        self.on_dead = on_dead
        self.processor: OutputProcessor | None = None
        self._channels: set[OutputChannel] = set()
        self._tracked: dict[str, OutputChannel] = {}
        self._stopping = False
        self._started = False
        self.dead: BaseException | None = None
        self.stats = EngineStatsSnapshot()

    # ---------------------------------------------------------------- life
    async def start(self) -> None:
        """Start the client (engine cores ready, tokenizer loaded)."""
        client = self.client
        client.set_callbacks(self._on_outputs, self._on_stats, self._on_dead)
        await client.start()
        self.processor = OutputProcessor(client.tokenizer, collect_stats=True)
        self._started = True

    @property
    def tokenizer(self) -> Any:
        return self.client.tokenizer

    @property
    def config(self) -> Any:
        """The ``EngineConfig``, as resolved by the engine cores (``max_model_len``...)."""
        return self.client.config

    @property
    def engine(self) -> Any:
        """The ``EngineCore`` when it runs in this process (tests), else None."""
        return getattr(self.client, "core", None)

    @property
    def image_input_spec(self) -> Any:
        """How the model takes images (``engine.multimodal.ImageInputSpec``; None: text only),
        as the engine cores reported it."""
        return getattr(self.client, "image_input_spec", None)

    @property
    def is_running(self) -> bool:
        return self._started and self.dead is None and not self._stopping

    @property
    def num_open_channels(self) -> int:
        """HTTP requests still being served (used to drain on shutdown)."""
        return len(self._channels)

    async def shutdown(self) -> None:
        """Stop: unfinished requests fail with ``EngineStoppedError``; the client (and the
        engine-core processes this server started) shut down. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        if self._tracked and self.dead is None:
            self.client.abort_requests(list(self._tracked))
        self._tracked.clear()
        self._fail_channels(EngineStoppedError("the server is shutting down"))
        await self.client.shutdown()

    # ---------------------------------------------------------------- requests
    def open_channel(self, stream: bool) -> OutputChannel:
        """A new output channel for one HTTP request."""
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        channel = OutputChannel(self, stream)
        self._channels.add(channel)
        return channel

    async def add_request(
        self,
        channel: OutputChannel,
        request_id: str,
        prompt: str | None,
        params: Any,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        mm_features: list[Any] | None = None,
        lora_request: Any = None,
    ) -> None:
        """Hand a request to an engine core; return once the core accepted it. ``mm_features``
        are the prompt's images (``engine.multimodal.MultiModalFeature``), ``lora_request``
        the ``LoRARequest`` it runs with (both travel with the request to the core).

        Raises what the core raised (``InvalidRequestError``...), or ``EngineDeadError`` /
        ``EngineStoppedError``.
        """
        await self.add_requests(
            channel,
            [
                dict(
                    request_id=request_id,
                    prompt=prompt,
                    params=params,
                    prompt_token_ids=prompt_token_ids,
                    priority=priority,
                    mm_features=mm_features,
                    lora_request=lora_request,
                )
            ],
        )

    async def add_requests(self, channel: OutputChannel, requests: list[dict[str, Any]]) -> None:
        """Hand several requests (each the keyword arguments of ``add_request`` but
        ``channel``) to the engine cores at once: each core takes its share between two
        steps, so they run in one batch (beam search's per-beam requests). All or none: when
        a core refuses one, or the caller goes away, every one is aborted and forgotten
        before the error propagates."""
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        if self._stopping:
            raise EngineStoppedError("the engine is shutting down")
        reqs: list[EngineCoreRequest] = []
        try:
            for kw in requests:
                reqs.append(self._track(channel, **kw))
            await self.client.add_requests(reqs)
        except BaseException:
            # A refusal, or the caller went away while the core was busy: make sure nothing
            # is left behind (the taken ones are aborted; the client aborted all on cancel).
            ids = [r.request_id for r in reqs]
            self.abort(ids)
            for rid in ids:
                self._forget(rid, channel)
            raise

    def _track(
        self,
        channel: OutputChannel,
        request_id: str,
        prompt: str | None,
        params: Any,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        mm_features: list[Any] | None = None,
        lora_request: Any = None,
    ) -> EngineCoreRequest:
        """Register a request with the output processor and its channel; its core request."""
        if prompt_token_ids is None:
            prompt_token_ids = list(self.tokenizer(prompt).input_ids)
        now = time.monotonic()
        interval = self.stream_interval if channel.stream else FINAL_ONLY
        assert self.processor is not None
        pooling = None
        if isinstance(params, PoolingParams):  # an embedding: one output when it is done
            pooling, params = params, SamplingParams(max_tokens=1)
            self.processor.add_pooling_request(request_id, prompt, prompt_token_ids, now)
        else:
            self.processor.add_request(request_id, prompt, prompt_token_ids, params, now, interval)
        self._tracked[request_id] = channel
        channel.request_ids.append(request_id)
        channel.unfinished.add(request_id)
        return EngineCoreRequest(
            request_id,
            prompt_token_ids,
            params,
            now,
            priority,
            mm_features=mm_features or None,
            lora_request=lora_request,
            pooling_params=pooling,
            # The adapter loaded under that name now, never loaded by a request: the cores'
            # adapters are what every front end serves (engine.server.models).
            lora_loaded_only=lora_request is not None,
        )

    def _forget(self, request_id: str, channel: OutputChannel) -> None:
        if self.processor is not None:
            self.processor.abort_requests([request_id])
        self._tracked.pop(request_id, None)
        channel.unfinished.discard(request_id)
        if request_id in channel.request_ids:
            channel.request_ids.remove(request_id)

    async def call(self, method: str, *args: Any) -> Any:
        """Run ``EngineCore.<method>(*args)`` on every engine core between steps and return
        the combined result (or raise what a core raised): vLLM's engine utility calls
        (``add_lora``, ``remove_lora``, ``list_loras``)."""
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        if self._stopping:
            raise EngineStoppedError("the engine is shutting down")
        return await self.client.call_utility(method, *args)

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests by id (never blocks)."""
        ids = [rid for rid in request_ids if self._tracked.pop(rid, None) is not None]
        if not ids:
            return
        if self.processor is not None:
            self.processor.abort_requests(ids)
        if self.dead is None and not self._stopping:
            self.client.abort_requests(ids)

    # ---------------------------------------------------------------- from the cores
    def _on_outputs(self, outputs: list[Any]) -> None:
        """One core step's outputs: detokenize, apply stop strings, deliver, observe."""
        processor = self.processor
        if processor is None:
            return
        now = time.monotonic()
        processed = processor.process_outputs(outputs, now)
        if processed.sequences_to_finish:
            self.client.finish_sequences(processed.sequences_to_finish)
        tracked = self._tracked
        for out in processed.request_outputs:
            channel = tracked.get(out.request_id)
            if channel is None:
                continue
            if out.finished:
                del tracked[out.request_id]
            channel._push(out)
        observer = self.observer
        stats = processed.stats
        if observer is not None and stats is not None:
            for ttft in stats.first_token_latencies:
                observer.on_first_token(ttft)
            if stats.previous_token_times:
                observer.on_inter_tokens(
                    [(now - last, count) for last, count in stats.previous_token_times.items()]
                )
            for e2e, reasons in stats.finished:
                observer.on_finished(e2e, reasons)

    def _on_stats(self, engine: int, stats: EngineStats) -> None:
        from engine.engine_core.client import sum_stats

        by_engine = self.client.stats
        total = sum_stats([by_engine[i] for i in sorted(by_engine)])
        self.stats = EngineStatsSnapshot(total, total.num_used_blocks, total.time)
        if self.observer is not None:
            self.observer.on_stats(dict(by_engine), time.monotonic())

    def _on_dead(self, exc: BaseException) -> None:
        self.dead = exc
        self._tracked.clear()
        self._fail_channels(EngineDeadError(str(exc)))
        if self.on_dead is not None:
            self.on_dead(exc)

    def _fail_channels(self, exc: BaseException) -> None:
        for channel in list(self._channels):
            channel._push(exc)
