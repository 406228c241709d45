"""Run an ``LLMEngine`` in its own thread and stream its outputs to asyncio callers.

The engine is not thread-safe, so exactly one thread (the *engine thread*) ever touches it.
The HTTP side talks to it through two one-way paths:

* **in**: commands (add / abort / call) go into a lock-protected deque and an ``threading.Event``
  wakes the engine thread. When the engine has no work, the thread sleeps on that event: an
  idle server burns no CPU.
* **out**: after every ``step()`` the engine thread hands the new outputs to the event loop in
  one ``loop.call_soon_threadsafe`` call. Each HTTP request owns an ``OutputChannel`` (an
  unbounded deque plus a future to wake its reader), so a slow client never blocks the engine:
  its outputs queue up and the reader takes them all at once (see ``OutputChannel.get``).

A failure in the engine thread marks the engine dead: every in-flight request fails with
``EngineDeadError`` (HTTP 500), later requests fail at once, and ``/health`` answers 503. Nothing
ever waits on a thread that is gone. A model worker process that dies (tensor/pipeline
parallelism) is such a failure: the executor wakes the engine thread, idle or not.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger(__name__)

# How often (seconds) the engine thread refreshes the stats snapshot while it is busy.
_STATS_REFRESH_S = 0.5


class EngineDeadError(RuntimeError):
    """The engine thread failed; the server cannot serve requests any more (HTTP 500)."""


class EngineStoppedError(RuntimeError):
    """The engine was shut down (server draining ended) before the request finished (503)."""


class EngineObserver(Protocol):
    """Receives per-request timings and engine stats from the engine thread (metrics, logs).

    Every method runs in the engine thread and must be quick and never raise.
    """

    def on_first_token(self, ttft_s: float) -> None: ...

    def on_inter_tokens(self, intervals: list[tuple[float, int]]) -> None:
        """``(seconds, count)`` pairs: ``count`` requests got a token ``seconds`` after their
        previous one."""

    def on_finished(self, e2e_s: float, finish_reasons: list[str | None]) -> None: ...

    def on_stats(self, stats: Any, now: float) -> None: ...


@dataclass
class EngineStatsSnapshot:
    """The latest ``EngineStats`` and the KV blocks in use, as last read by the engine thread."""

    stats: Any = None
    num_used_blocks: int = 0
    time: float = 0.0


class OutputChannel:
    """The stream of engine outputs for one HTTP request (one or more engine requests).

    Lives on the event loop: ``_push`` is only ever called there (through
    ``call_soon_threadsafe``). ``stream=False`` channels receive only final outputs, which
    spares the event loop a wake-up per token for non-streaming requests.
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
        """Queue an output (a ``RequestOutput``) or an exception for the reader (loop thread)."""
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
        chunk. An exception delivered by the engine thread is raised here.
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


@dataclass
class _Tracked:
    """Engine-thread bookkeeping for one engine request."""

    channel: OutputChannel
    arrival: float
    last_token: float | None = None
    num_tokens: list[int] = field(default_factory=list)


class AsyncEngine:
    """Owns the engine thread; the asyncio-facing API of the server.

    ``add_request`` and ``abort`` are called from the event loop; everything that touches the
    ``LLMEngine`` runs in the engine thread, except grammar compilation (thread-safe, see
    ``_compile_structured_outputs``).
    """

    def __init__(
        self,
        engine: Any,
        *,
        observer: EngineObserver | None = None,
        idle_wakeup_s: float = 10.0,
    ) -> None:
        self.engine = engine
        self.observer = observer
        self._idle_wakeup_s = idle_wakeup_s
        self._lock = threading.Lock()
        self._inbox: deque[tuple] = deque()
        self._wakeup = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._channels: set[OutputChannel] = set()
        self.dead: BaseException | None = None
        self.stats = EngineStatsSnapshot()
        # Engine-thread state.
        self._tracked: dict[str, _Tracked] = {}

    # ---------------------------------------------------------------- loop side
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered to ``loop`` (the running loop)."""
        self._loop = loop or asyncio.get_running_loop()
        # A model worker that fails while the engine is idle wakes the engine thread, whose
        # health check then takes the dead-engine path (a busy engine's step raises anyway).
        register = getattr(self.engine, "set_failure_callback", None)
        if register is not None:
            register(self._wakeup.set)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        """The engine thread is alive and has not failed."""
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    @property
    def num_open_channels(self) -> int:
        """HTTP requests still being served (used to drain on shutdown)."""
        return len(self._channels)

    def open_channel(self, stream: bool) -> OutputChannel:
        """A new output channel for one HTTP request."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine failed: {self.dead!r}")
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
        """Hand a request to the engine; return once the engine accepted it. ``mm_features``
        are the prompt's images (``engine.multimodal.MultiModalFeature``).

        Raises what ``LLMEngine.add_request`` raised (``InvalidRequestError``...), or
        ``EngineDeadError`` / ``EngineStoppedError``.
        """
        await self._compile_structured_outputs(params)
        loop = asyncio.get_running_loop()
        ack: asyncio.Future[None] = loop.create_future()
        cmd = (
            "add",
            channel,
            request_id,
            prompt,
            params,
            prompt_token_ids,
            priority,
            ack,
            mm_features,
            lora_request,
        )
        self._put(cmd, time.monotonic())
        channel.request_ids.append(request_id)
        channel.unfinished.add(request_id)
        try:
            await ack
        except asyncio.CancelledError:
            # The caller went away while the engine was busy: make sure nothing is left behind
            # (the abort is queued after the add, so the engine sees them in that order).
            self.abort([request_id])
            raise
        except BaseException:
            channel.unfinished.discard(request_id)
            channel.request_ids.remove(request_id)
            raise

    async def _compile_structured_outputs(self, params: Any) -> None:
        """Compile a request's structured-outputs grammar on a worker thread, so that the
        engine thread finds it in the grammar cache. The first grammar builds xgrammar's
        tokenizer info (about 1.5 s for a 262k-token vocabulary on 2 cores) and each new schema
        takes tens of milliseconds: on the engine thread, every other request would wait that
        long. The one exception to "only the engine thread touches the engine": the
        ``StructuredOutputManager`` is thread-safe. A constraint that does not compile raises
        here, as ``LLMEngine.add_request`` would."""
        constraint = getattr(params, "structured_outputs", None)
        manager = getattr(self.engine, "structured_outputs", None) if constraint else None
        if manager is not None:
            await asyncio.to_thread(manager.compile, constraint)

    async def call(self, method: str, *args: Any) -> Any:
        """Run ``engine.<method>(*args)`` on the engine thread between steps and return its
        result (or raise what it raised): vLLM's engine utility calls (``add_lora``,
        ``remove_lora``, ...)."""
        ack: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._put(("call", method, args, ack), 0.0)
        return await ack

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests by id (delivered to the engine thread; never blocks)."""
        if request_ids and self.dead is None:
            try:
                self._put(("abort", list(request_ids)), 0.0)
            except (EngineDeadError, EngineStoppedError):
                pass

    def _put(self, cmd: tuple, now: float) -> None:
        with self._lock:
            if self.dead is not None:
                raise EngineDeadError(f"the engine failed: {self.dead!r}")
            if self._stopping:
                raise EngineStoppedError("the engine is shutting down")
            self._inbox.append((*cmd, now) if cmd[0] == "add" else cmd)
        self._wakeup.set()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the engine thread; unfinished requests fail with ``EngineStoppedError``."""
        with self._lock:
            self._stopping = True
        self._wakeup.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _deliver(self, batch: list[tuple[OutputChannel, Any]]) -> None:
        """Loop thread: push a step's outputs into their channels."""
        for channel, item in batch:
            channel._push(item)

    def _resolve_acks(self, acks: list[tuple]) -> None:
        """``(future, exception or None[, result])`` triples from the engine thread."""
        for fut, exc, *result in acks:
            if fut.done():
                continue
            if exc is None:
                fut.set_result(result[0] if result else None)
            else:
                fut.set_exception(exc)

    def _fail_channels(self, exc: BaseException) -> None:
        """Loop thread: fail every open channel (engine dead or stopped)."""
        for channel in list(self._channels):
            channel._push(exc)

    # -------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            self._serve_forever()
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine, loudly
            logger.exception("engine thread failed; the server cannot serve any more requests")
            with self._lock:
                self.dead = e
                pending = list(self._inbox)
                self._inbox.clear()
            err = EngineDeadError(f"the engine failed: {e!r}")
            self._shut_down_thread(pending, err)
            return
        with self._lock:
            pending = list(self._inbox)
            self._inbox.clear()
        self._shut_down_thread(pending, EngineStoppedError("the server is shutting down"))

    def _shut_down_thread(self, pending: list[tuple], err: BaseException) -> None:
        acks = [(cmd[7], err) for cmd in pending if cmd[0] == "add"]
        acks += [(cmd[3], err) for cmd in pending if cmd[0] == "call"]
        self._tracked.clear()
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._resolve_acks, acks)
                loop.call_soon_threadsafe(self._fail_channels, err)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _serve_forever(self) -> None:
        engine = self.engine
        loop = self._loop
        assert loop is not None
        last_stats = 0.0
        check_health = getattr(engine, "check_health", None) or (lambda: None)
        while True:
            self._wakeup.clear()
            check_health()  # raises when a model worker failed
            self._process_inbox()
            if self._stopping:
                self._abort_all()
                return
            if not engine.has_unfinished_requests():
                self._refresh_stats(time.monotonic())
                # Sleep until a command arrives (or the stats logger wants a last word).
                self._wakeup.wait(self._idle_wakeup_s)
                continue
            outputs = engine.step()
            now = time.monotonic()
            if outputs:
                batch = self._route(outputs, now)
                if batch:
                    loop.call_soon_threadsafe(self._deliver, batch)
            if now - last_stats >= _STATS_REFRESH_S:
                last_stats = now
                self._refresh_stats(now)

    def _process_inbox(self) -> None:
        with self._lock:
            if not self._inbox:
                return
            cmds = list(self._inbox)
            self._inbox.clear()
        acks: list[tuple] = []
        aborts: list[str] = []
        for cmd in cmds:
            if cmd[0] == "call":
                _, method, args, ack = cmd
                try:
                    acks.append((ack, None, getattr(self.engine, method)(*args)))
                except Exception as e:  # noqa: BLE001 - refused (a bad adapter...), engine intact
                    acks.append((ack, e))
            elif cmd[0] == "add":
                _, channel, rid, prompt, params, ids, priority, ack, images, lora, arrival = cmd
                try:
                    kwargs: dict[str, Any] = {}
                    if images:
                        kwargs["mm_features"] = images
                    if lora is not None:
                        kwargs["lora_request"] = lora
                    self.engine.add_request(
                        rid, prompt, params, prompt_token_ids=ids, priority=priority, **kwargs
                    )
                except Exception as e:  # noqa: BLE001 - rejected request, engine intact
                    acks.append((ack, e))
                    continue
                self._tracked[rid] = _Tracked(channel, arrival)
                acks.append((ack, None))
            else:
                aborts.extend(rid for rid in cmd[1] if rid in self._tracked)
        if aborts:
            self.engine.abort_request(aborts)
            for rid in aborts:
                del self._tracked[rid]
        if acks:
            self._loop.call_soon_threadsafe(self._resolve_acks, acks)

    def _route(self, outputs: list[Any], now: float) -> list[tuple[OutputChannel, Any]]:
        """Pair each output with its channel and record latency metrics.

        Runs on the engine's critical path, so it stays cheap: inter-token latencies are
        grouped by the time of each request's previous token (most requests of a decode batch
        share it) and handed to the observer once per step.
        """
        batch = []
        observer = self.observer
        tracked = self._tracked
        previous: dict[float, int] = {}
        for out in outputs:
            t = tracked.get(out.request_id)
            if t is None:  # aborted meanwhile
                continue
            if any(out.new_token_ids):
                last = t.last_token
                if last is None:
                    if observer is not None:
                        observer.on_first_token(now - t.arrival)
                else:
                    previous[last] = previous.get(last, 0) + 1
                t.last_token = now
            if out.finished:
                del tracked[out.request_id]
                if observer is not None:
                    observer.on_finished(now - t.arrival, [c.finish_reason for c in out.outputs])
                batch.append((t.channel, out))
            elif t.channel.stream:
                batch.append((t.channel, out))
        if previous and observer is not None:
            observer.on_inter_tokens([(now - last, count) for last, count in previous.items()])
        return batch

    def _abort_all(self) -> None:
        if self._tracked:
            self.engine.abort_request(list(self._tracked))
            self._tracked.clear()
        self._refresh_stats(time.monotonic())

    def _refresh_stats(self, now: float) -> None:
        stats = self.engine.get_stats()
        self.stats = EngineStatsSnapshot(stats, int(self.engine.num_used_blocks), now)
        if self.observer is not None:
            self.observer.on_stats(stats, now)
