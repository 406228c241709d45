"""Asynchronous clients of engine cores, for the HTTP server's ``AsyncEngine``.

- ``AsyncMPClient``: engine-core processes over ZMQ, what ``engine serve`` runs. The front end
  binds a PULL socket for its outputs (one ``EngineCoreOutputs`` per core step, read by a task
  of the event loop) and pushes requests to each core's PULL socket. It watches every core's
  process (a pidfd on Linux): a core that dies fails the engine at once.
- ``ThreadedCoreClient``: the same ``CoreLoop`` in a thread of this process, with no
  encoding (tests, and embedding a server in a process that already holds an ``EngineCore``).

Both route requests with ``DataParallelRouter``, answer ``add_request(s)`` once the cores took
the requests (raising what the core raised when it refused it), and call back the ``AsyncEngine``
in the event loop's thread: ``on_outputs(outputs)`` per core step, ``on_stats(engine, stats)``,
``on_dead(exc)`` when a core fails or its process dies.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from engine.engine_core.messages import (
    UTILITY_METHODS,
    AbortRequests,
    AddRequests,
    AddResult,
    AllFrontEndsReady,
    CoreFailed,
    CoreReady,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    FinishSequences,
    FrontEndReady,
    UtilityCall,
    UtilityResult,
    raise_request_error,
)
from engine.engine_core.routing import DataParallelRouter

logger = logging.getLogger(__name__)


class _AsyncClient:
    """What both asynchronous clients share: acknowledgements, routing, callbacks."""

    def __init__(self) -> None:
        self.router = DataParallelRouter(1)
        self.dead: BaseException | None = None
        self.stats: dict[int, EngineStats] = {}
        self._acks: dict[str, asyncio.Future] = {}
        # Utility calls waiting for their cores: call id -> (future, results by core, how
        # many cores were asked).
        self._calls: dict[int, tuple[asyncio.Future, dict[int, Any], int]] = {}
        self._next_call_id = 0
        self._on_outputs: Callable[[list[Any]], None] = lambda outputs: None
        self._on_stats: Callable[[int, EngineStats], None] = lambda engine, stats: None
        self._on_dead: Callable[[BaseException], None] = lambda exc: None
        self._closing = False
        self.client_index = 0  # which front end this is, for the cores

    def set_callbacks(
        self,
        on_outputs: Callable[[list[Any]], None],
        on_stats: Callable[[int, EngineStats], None],
        on_dead: Callable[[BaseException], None],
    ) -> None:
        self._on_outputs, self._on_stats, self._on_dead = on_outputs, on_stats, on_dead

    @property
    def num_engines(self) -> int:
        return self.router.num_engines

    # ------------------------------------------------------------------ loop thread
    def _on_message(self, msg: Any) -> None:
        if isinstance(msg, EngineCoreOutputs):
            if msg.stats is not None:
                self.stats[msg.engine_index] = msg.stats
                self.router.on_stats(msg.engine_index, msg.stats)
                self._on_stats(msg.engine_index, msg.stats)
            if msg.outputs:
                self.router.on_outputs(msg.outputs)
                self._on_outputs(msg.outputs)
        elif isinstance(msg, AddResult):
            acks = self._acks
            for rid in msg.accepted:
                fut = acks.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
            for err in msg.rejected:
                self.router.request_done(err.request_id)
                fut = acks.pop(err.request_id, None)
                if fut is not None and not fut.done():
                    try:
                        raise_request_error(err)
                    except Exception as e:  # noqa: BLE001 - handed to the waiting request
                        fut.set_exception(e)
        elif isinstance(msg, UtilityResult):
            call = self._calls.get(msg.call_id)
            if call is None:
                return
            fut, results, expected = call
            results[msg.engine_index] = msg
            if len(results) < expected:
                return
            del self._calls[msg.call_id]
            if not fut.done():
                fut.set_result([results[i] for i in sorted(results)])
        elif isinstance(msg, CoreFailed):
            from engine.engine_core.client import dead_error

            self._die(dead_error(msg.engine_index, failed=msg))

    def _die(self, exc: BaseException) -> None:
        if self.dead is not None or self._closing:
            return
        self.dead = exc
        logger.error("%s; the server cannot serve requests any more", exc)
        for fut in self._acks.values():
            if not fut.done():
                fut.set_exception(exc)
        self._acks.clear()
        for fut, _, _ in self._calls.values():
            if not fut.done():
                fut.set_exception(exc)
        self._calls.clear()
        self._on_dead(exc)

    def _send(self, engine: int, msg: Any) -> None:
        raise NotImplementedError

    async def add_request(self, req: EngineCoreRequest) -> None:
        """Send a request to the core the router picks; return once it was taken."""
        await self.add_requests([req])

    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Route requests and send each core its share in one message (so a core takes them
        all between two steps, into one batch); return once every one was taken. Raises the
        first refusal after all answered (the others were taken: the caller aborts them);
        cancelled, it aborts them all (queued after the adds: the cores see both)."""
        if self.dead is not None:
            raise self.dead
        loop = asyncio.get_running_loop()
        per_engine: dict[int, list[EngineCoreRequest]] = {}
        futs = []
        for req in requests:
            req.client_index = self.client_index
            engine, hashes = self.router.choose(req.prompt_token_ids)
            self.router.add(req.request_id, engine, req.sampling_params.n, hashes)
            fut = loop.create_future()
            self._acks[req.request_id] = fut
            futs.append(fut)
            per_engine.setdefault(engine, []).append(req)
        for engine, reqs in per_engine.items():
            self._send(engine, AddRequests(reqs))
        ids = [req.request_id for req in requests]
        try:
            results = await asyncio.gather(*futs, return_exceptions=True)
        except asyncio.CancelledError:
            for rid in ids:
                self._acks.pop(rid, None)
            self.abort_requests(ids)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for rid, r in zip(ids, results, strict=True):
                if isinstance(r, BaseException):
                    self._acks.pop(rid, None)
                    self.router.request_done(rid)
            raise errors[0]

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Run ``EngineCore.<method>(*args)`` (``UTILITY_METHODS``) on every core between
        steps and return their combined answer (``combine_utility_results``), or raise what
        a core raised: a LoRA adapter is loaded or removed in every data-parallel rank.

        ``add_lora`` is all or nothing: when some cores load the adapter and others refuse
        it, the ones that loaded it drop it again (an in-place reload gets the old adapter
        back) before the refusal is raised, naming the core and its reason, so every core
        keeps the same adapters (``engine.engine_core.lora_loads``, shared with the
        synchronous client). Shielded: a caller that goes away does not stop it half way."""
        if self.dead is not None:
            raise self.dead
        if method not in UTILITY_METHODS:
            raise ValueError(f"unknown engine utility call {method!r}")
        from engine.engine_core.utility_results import combine_utility_results

        if method == "add_lora":
            return await asyncio.shield(self._add_lora_everywhere(*args))
        results = await self._call_each(method, list(args), range(self.num_engines))
        return combine_utility_results(method, results)

    async def _call_each(self, method: str, args: list[Any], engines: Any) -> list[Any]:
        """Every asked core's ``UtilityResult`` of one call, in core order."""
        engines = list(engines)
        self._next_call_id += 1
        call_id = self._next_call_id
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (fut, {}, len(engines))
        msg = UtilityCall(call_id, method, args, self.client_index)
        for engine in engines:
            self._send(engine, msg)
        try:
            return await fut
        finally:
            self._calls.pop(call_id, None)

    async def _add_lora_everywhere(self, *args: Any) -> bool:
        """``engine.engine_core.lora_loads.add_lora_everywhere``, driven with awaits."""
        from engine.engine_core.lora_loads import add_lora_everywhere

        steps = add_lora_everywhere(list(args), self.num_engines)
        results = None
        try:
            while True:
                results = await self._call_each(*steps.send(results))
        except StopIteration as done:
            return done.value

    def _by_engine(self, items: list[Any], key: Callable[[Any], str]) -> dict[int, list[Any]]:
        groups: dict[int, list[Any]] = {}
        for item in items:
            engine = self.router.engine_of(key(item))
            if engine is not None:
                groups.setdefault(engine, []).append(item)
        return groups

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests in their cores (never blocks; unknown ids are ignored)."""
        if self.dead is not None or self._closing:
            return
        for engine, ids in self._by_engine(list(request_ids), lambda r: r).items():
            self._send(engine, AbortRequests(ids))
        for rid in request_ids:
            self.router.request_done(rid)

    def finish_sequences(self, sequences: list[tuple[str, int]]) -> None:
        """Tell the cores about sequences a stop string ended."""
        if self.dead is not None or self._closing:
            return
        for engine, part in self._by_engine(sequences, lambda s: s[0]).items():
            self._send(engine, FinishSequences(part))
        for rid, index in sequences:
            self.router.sequence_done(rid, index)


class ThreadedCoreClient(_AsyncClient):
    """An ``EngineCore`` (or anything with its interface) driven by a ``CoreLoop`` in a thread
    of this process. Messages are passed as objects, not encoded."""

    def __init__(self, core: Any) -> None:
        super().__init__()
        self.core = core
        self.tokenizer = core.tokenizer
        self.config = core.config
        self.eos_token_ids = list(getattr(core, "eos_token_ids", []))
        self.image_input_spec = getattr(core, "image_input_spec", None)
        self._loop_runner: Any = None
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        from engine.engine_core.proc import CoreLoop

        loop = asyncio.get_running_loop()

        def send(client: int, msg: Any) -> None:
            try:
                loop.call_soon_threadsafe(self._on_message, msg)
            except RuntimeError:  # the loop closed meanwhile
                pass

        self._loop_runner = CoreLoop(self.core, send)
        self._thread = threading.Thread(target=self._run, args=(loop,), name="engine-loop")
        self._thread.daemon = True
        self._thread.start()

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            try:
                self._loop_runner.run()
            finally:
                shutdown = getattr(self.core, "shutdown", None)
                if shutdown is not None:  # the model's worker processes, if any
                    shutdown()
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine, loudly
            from engine.errors import EngineDeadError

            logger.exception("the engine core thread failed")
            err = EngineDeadError(f"the engine failed: {e!r}")
            try:
                loop.call_soon_threadsafe(self._die, err)
            except RuntimeError:
                pass

    def _send(self, engine: int, msg: Any) -> None:
        self._loop_runner.inbox.put(msg)

    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """As the base class, after compiling a structured-outputs grammar on a worker thread
        (so the core's thread finds it in the grammar cache: a new schema takes tens of
        milliseconds, and the first one builds xgrammar's tokenizer info, seconds for a large
        vocabulary; on the core's thread every other request would wait that long). A
        constraint that does not compile raises here, as the core would."""
        manager = getattr(self.core, "structured_outputs", None)
        for req in requests:
            constraint = req.sampling_params.structured_outputs
            if constraint and manager is not None:
                await asyncio.to_thread(manager.compile, constraint)
        await super().add_requests(requests)

    async def shutdown(self) -> None:
        self._closing = True
        if self._loop_runner is not None:
            self._loop_runner.stop()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            await asyncio.to_thread(thread.join, 30)


class AsyncMPClient(_AsyncClient):
    """Engine cores in processes of their own; see the module docstring.

    ``connection`` says where the cores listen and where this front end receives; the
    ``processes`` are given when this front end started the cores (it then stops them).
    """

    def __init__(self, config: Any, connection: Any, processes: Any = None) -> None:
        super().__init__()
        self.config = config
        self.connection = connection
        self.client_index = connection.client_index
        self.processes = processes
        self.core = None
        self.tokenizer: Any = None
        self.eos_token_ids: list[int] = []
        self.vocab_size = 0
        self.image_input_spec: Any = None
        self.ready: list[CoreReady] = []
        self._ctx: Any = None
        self._out: Any = None
        self._ins: list[Any] = []
        self._reader: asyncio.Task | None = None
        self._unwatch: list[Callable[[], None]] = []
        self._ready_waiter: asyncio.Future | None = None
        self._ready: dict[int, CoreReady] = {}

    @classmethod
    def launch(cls, config: Any, *, log_level: str = "info") -> AsyncMPClient:
        """Start the engine-core processes for ``config`` (one per data-parallel rank) and
        return a client of them, not started yet."""
        from engine.engine_core.proc import EngineCoreProcesses

        processes = EngineCoreProcesses(config, num_clients=1, log_level=log_level)
        return cls(config, processes.connection(0), processes)

    async def start(self) -> None:
        """Connect, load the tokenizer while the cores load, and wait until all are ready.
        Raises the cores' startup error (``ConfigError`` for configuration problems)."""
        import zmq
        import zmq.asyncio

        from engine.engine_core.messages import Codec
        from engine.engine_core.processes import watch_process
        from engine.engine_core.transport import make_socket
        from engine.tokenizer import load_tokenizer

        loop = asyncio.get_running_loop()
        conn = self.connection
        self._codec = Codec()
        self._ctx = zmq.asyncio.Context(io_threads=1)
        self._sync_ctx = zmq.Context.shadow(self._ctx.underlying)  # plain sockets for sending
        self._out = make_socket(self._ctx, zmq.PULL, conn.output_address, bind=True)
        self._ins = [
            make_socket(self._sync_ctx, zmq.PUSH, a, bind=False) for a in conn.input_addresses
        ]
        self._ready_waiter = loop.create_future()
        self._reader = loop.create_task(self._read())
        procs = self.processes.procs if self.processes is not None else [None] * len(conn.pids)
        for i, pid in enumerate(conn.pids):
            proc = procs[i]
            popen = proc.popen if proc is not None else None
            on_exit = functools.partial(self._core_exited, i, proc)
            self._unwatch.append(watch_process(loop, pid, on_exit, popen))
        tokenizer = asyncio.ensure_future(
            asyncio.to_thread(_front_end_tokenizer, load_tokenizer, self.config.model)
        )
        try:
            await self._ready_waiter
        except BaseException:
            # The cores' error is the one to report (the tokenizer may fail the same way).
            tokenizer.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise
        self.tokenizer = await tokenizer
        if conn.num_clients > 1:
            # Serve only once every front end can: they share the port, so a client must
            # never meet one still starting after another answered /health.
            self._ready_waiter = loop.create_future()
            self._send(0, FrontEndReady(self.client_index))
            await self._ready_waiter
        first = self.ready[0]
        from engine.engine_core.client import apply_ready

        apply_ready(self.config, first)
        self.vocab_size = first.vocab_size
        self.eos_token_ids = list(first.eos_token_ids)
        self.image_input_spec = first.image_input_spec
        self.router = DataParallelRouter(
            len(self.ready), first.block_size, enable_prefix_caching=first.enable_prefix_caching
        )

    def _core_exited(self, engine: int, proc: Any) -> None:
        if self._closing:
            return
        from engine.engine_core.client import dead_error

        waiter = self._ready_waiter
        if waiter is not None and waiter.done() and waiter.exception() is not None:
            return  # it failed to start and said why: that error is the one to report
        err = dead_error(engine, proc)
        if proc is None:
            from engine.errors import EngineDeadError

            pid = self.connection.pids[engine]
            err = EngineDeadError(f"engine core {engine} (pid {pid}) died")
        if waiter is not None and not waiter.done():
            waiter.set_exception(RuntimeError(f"{err} while loading the model"))
            return
        self._die(err)

    async def _read(self) -> None:
        decode = self._codec.from_core.decode
        sock = self._out
        while True:
            frame = await sock.recv(copy=False)
            try:
                msg = decode(frame.buffer)
            except Exception:  # noqa: BLE001 - a malformed message is a bug in a core
                logger.exception("dropping an undecodable message from an engine core")
                continue
            waiter = self._ready_waiter
            if waiter is not None and not waiter.done():
                if isinstance(msg, CoreReady):
                    self._ready[msg.engine_index] = msg
                    if len(self._ready) == len(self._ins):
                        self.ready = [self._ready[i] for i in range(len(self._ins))]
                        waiter.set_result(None)
                    continue
                if isinstance(msg, CoreFailed):
                    from engine.engine_core.client import startup_error

                    waiter.set_exception(startup_error(msg))
                    continue
                if isinstance(msg, AllFrontEndsReady):
                    waiter.set_result(None)
                    continue
            try:
                self._on_message(msg)
            except Exception:  # noqa: BLE001 - keep reading: one bad output must not hang all
                logger.exception("failed to process engine-core outputs")

    def _send(self, engine: int, msg: Any) -> None:
        self._ins[engine].send(self._codec.encode(msg), copy=False)

    async def shutdown(self) -> None:
        """Close the sockets and, when this front end started them, stop the cores."""
        if self._closing:
            return
        self._closing = True
        for cancel in self._unwatch:
            cancel()
        if self._reader is not None:
            self._reader.cancel()
        if self.processes is not None:
            await asyncio.to_thread(self.processes.stop)
        for sock in (self._out, *self._ins):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()


def _front_end_tokenizer(load: Callable[[Any], Any], model_config: Any) -> Any:
    """The tokenizer the front end detokenizes with (None with ``skip_tokenizer_init``)."""
    return None if model_config.skip_tokenizer_init else load(model_config)
