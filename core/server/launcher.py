"""Run the app under uvicorn: load the engine behind a live port, drain on SIGTERM.

The listening socket is bound first, so ``/health`` answers 503 while the model loads (in the
engine-core processes, while this process loads the tokenizer). The first SIGTERM/SIGINT
starts a drain: ``/health`` and new requests get 503, in-flight requests get up to
``shutdown_timeout`` seconds to finish, the rest are aborted, then the process exits 0. A
second signal exits at once.

If an engine core dies (``kill -9``, a device error, out of memory), every in-flight request
ends at once with an ``engine_dead`` error (in-band for streams), ``/health`` answers 503, and
once those responses are written (at most ``_DEATH_FLUSH_S`` seconds) the server exits with
status 1, so that a supervisor (systemd, Kubernetes) restarts it: a fresh start is the one
recovery that cannot leave half a server behind. ``LaunchOptions.exit_on_engine_death=False``
keeps it up instead, answering every request with that error.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from engine.server.app import Phase, ServerOptions, ServerState, build_app
from engine.server.async_engine import AsyncEngine
from engine.server.metrics import ServerMetrics
from engine.server.models import preload_lora_adapters
from engine.server.serving import ServingContext

logger = logging.getLogger("engine.server")

# After an engine core died: how long the failed responses get to reach their clients.
_DEATH_FLUSH_S = 5.0


@dataclass
class LaunchOptions:
    """How to run the HTTP server."""

    host: str = "127.0.0.1"
    port: int = 8000
    shutdown_timeout: float = 30.0
    log_stats_interval: float = 10.0
    access_log: bool = True
    quiet_paths: Iterable[str] = field(default_factory=tuple)
    log_level: str = "info"
    started_at: float | None = None  # time.monotonic() when the command started
    stream_interval: int = 1  # tokens per streamed chunk (--stream-interval)
    exit_on_engine_death: bool = True  # exit 1 once an engine core died (module docstring)
    # Of --api-server-count front ends: this one's index (front end 0 logs the stats line).
    api_server_index: int = 0
    api_server_count: int = 1
    # Behind a proxy that serves the API under a path prefix (vLLM's --root-path).
    root_path: str = ""
    # TLS (vLLM's --ssl-keyfile, --ssl-certfile, --ssl-ca-certs, --ssl-cert-reqs): the
    # server speaks HTTPS when a key and a certificate are given.
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE; 2 (CERT_REQUIRED) asks clients for certificates


class _QuietPaths(logging.Filter):
    """Drops uvicorn access-log lines for the given paths (e.g. /health, /metrics)."""

    def __init__(self, paths: Iterable[str]) -> None:
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in self.paths
        return True


class _Uvicorn(uvicorn.Server):
    """uvicorn's server with our shutdown: drain first, then let uvicorn close."""

    def __init__(self, config: uvicorn.Config, owner: ApiServer) -> None:
        super().__init__(config)
        self._owner = owner

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Not uvicorn's: it would re-raise the signal after shutdown (exit status -15).
        self._owner.request_shutdown()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self._owner._on_started()


class ApiServer:
    """The OpenAI-compatible server around an engine built by ``engine_factory``.

    ``engine_factory()`` runs in a worker thread and returns an asynchronous engine-core
    client, not started (``AsyncMPClient.launch(config)``: engine-core processes), or an
    ``EngineCore`` (which then runs in a thread of this process). ``run()`` blocks (signals
    handled when it runs in the main thread); tests run ``serve()`` in a thread and call
    ``request_shutdown()``.
    """

    def __init__(
        self,
        engine_factory: Callable[[], Any],
        options: ServerOptions,
        launch: LaunchOptions,
        sock: socket.socket | None = None,
    ) -> None:
        self.engine_factory = engine_factory
        self.options = options
        self.launch = launch
        self.state = ServerState()
        self.app = build_app(options, self.state)
        self.sock = sock or bind_socket(launch.host, launch.port)
        self.port = self.sock.getsockname()[1]
        self.exit_code = 0
        self.ready = threading.Event()  # set once the engine serves (or failed to load)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shutdown_started = False
        self._tasks: set[asyncio.Task] = set()
        self._stats_timer: asyncio.TimerHandle | None = None
        access_logger = logging.getLogger("uvicorn.access")
        if launch.quiet_paths:
            access_logger.addFilter(_QuietPaths(launch.quiet_paths))
        config = uvicorn.Config(
            self.app,
            log_config=None,  # our logging setup; uvicorn's loggers propagate to the root
            log_level=launch.log_level,
            access_log=launch.access_log,
            timeout_graceful_shutdown=5,
            lifespan="off",
            root_path=launch.root_path,
            ssl_keyfile=launch.ssl_keyfile,
            ssl_certfile=launch.ssl_certfile,
            ssl_ca_certs=launch.ssl_ca_certs,
            ssl_cert_reqs=launch.ssl_cert_reqs,
        )
        self._server = _Uvicorn(config, self)

    # ----------------------------------------------------------------- running
    def run(self) -> int:
        """Serve until shut down; return the exit status.

        The event loop is uvicorn's choice (uvloop when installed, else asyncio's).
        """
        config = self._server.config
        loop_factory = None
        if hasattr(config, "get_loop_factory"):  # uvicorn >= 0.36
            loop_factory = config.get_loop_factory()
        elif hasattr(config, "setup_event_loop"):
            config.setup_event_loop()
        if loop_factory is not None and hasattr(asyncio, "Runner"):
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                runner.run(self.serve())
        else:
            asyncio.run(self.serve())
        if self.state.startup_error is not None:
            # Let the CLI report it: one paragraph for configuration and plugin errors, a
            # traceback for anything else.
            raise self.state.startup_error
        return self.exit_code

    async def serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            await self._server.serve(sockets=[self.sock])
        finally:
            if self._stats_timer is not None:
                self._stats_timer.cancel()
            for task in list(self._tasks):
                task.cancel()
            engine = self._engine
            if engine is not None:
                await engine.shutdown()
            if self.state.ctx is not None:
                self.state.ctx.close()
            # Give back what _start_engine froze: frozen objects are never collected, not even
            # at interpreter exit, so reference cycles among extension objects (Triton's
            # nanobind IR attributes) would outlive their module and be reported as leaks.
            gc.unfreeze()
            self.ready.set()

    _engine: AsyncEngine | None = None

    def _on_started(self) -> None:
        logger.info("listening on http://%s:%d (loading the model)", self.launch.host, self.port)
        self._spawn(self._load_engine())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _load_engine(self) -> None:
        from engine.engine_core.async_client import ThreadedCoreClient

        launch = self.launch
        try:
            source = await asyncio.to_thread(self.engine_factory)
            client = source if hasattr(source, "set_callbacks") else ThreadedCoreClient(source)
            engine = AsyncEngine(
                client, stream_interval=launch.stream_interval, on_dead=self._on_engine_dead
            )
            self._engine = engine
            await engine.start()
            # --lora-modules, in every engine core, before the server serves
            await preload_lora_adapters(engine, self.options.serving.lora_requests)
        except BaseException as e:  # noqa: BLE001 - re-raised by run() once uvicorn stopped
            # run() re-raises it for the caller (the CLI prints it once, as one line).
            logger.info("the engine failed to load; stopping the server")
            self.state.startup_error = e
            self.exit_code = 1
            self._server.should_exit = True
            self.ready.set()
            return
        if self._shutdown_started:
            return
        serving = self.options.serving
        names = list(serving.served_model_names) or engine.config.model.served_model_names
        stats_interval = launch.log_stats_interval if launch.api_server_index == 0 else 0.0
        metrics = ServerMetrics(names[0], log_stats_interval_s=stats_interval)
        engine.observer = metrics
        if stats_interval > 0:
            self._schedule_stats_tick(metrics, stats_interval)
        # Everything allocated so far (tokenizer, imported modules) lives as long as the
        # server: keep the garbage collector from re-scanning it on every collection, which
        # otherwise costs a noticeable share of the per-token streaming time.
        gc.collect()
        gc.freeze()
        ctx = ServingContext(engine, serving)
        self.state.set_ready(ctx, metrics)
        took = ""
        if launch.started_at is not None:
            took = f" in {time.monotonic() - launch.started_at:.2f} s"
        where = ""
        if launch.api_server_count > 1:
            where = f" (API server {launch.api_server_index} of {launch.api_server_count})"
        cores = engine.client.num_engines
        logger.info(
            "ready%s: serving %s (max_model_len=%d) on http://%s:%d%s with %d engine core%s",
            took,
            ", ".join(ctx.model_names),
            ctx.max_model_len,
            launch.host,
            self.port,
            where,
            cores,
            "" if cores == 1 else "s",
        )
        self.ready.set()

    def _schedule_stats_tick(self, metrics: ServerMetrics, interval: float) -> None:
        loop = asyncio.get_running_loop()

        def tick() -> None:
            metrics.stats_logger.tick(time.monotonic())
            self._stats_timer = loop.call_later(interval, tick)

        self._stats_timer = loop.call_later(interval, tick)

    def _on_engine_dead(self, exc: BaseException) -> None:
        """An engine core died (loop thread): the failed responses flush, then we exit 1."""
        if not self.launch.exit_on_engine_death or self._shutdown_started:
            return
        self._shutdown_started = True
        self.exit_code = 1
        self._spawn(self._exit_after_death())

    async def _exit_after_death(self) -> None:
        state = self.state
        engine = self._engine
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _DEATH_FLUSH_S
        while engine is not None and engine.num_open_channels and loop.time() < deadline:
            await asyncio.sleep(0.02)
        logger.error("exiting (status 1): an engine core is gone")
        state.phase = Phase.STOPPED
        self._server.should_exit = True

    # ---------------------------------------------------------------- shutdown
    def request_shutdown(self) -> None:
        """Begin draining (thread- and signal-safe); a second call exits at once."""
        loop = self._loop
        if self._shutdown_started or loop is None:
            self._server.should_exit = True
            self._server.force_exit = True
            return
        self._shutdown_started = True
        loop.call_soon_threadsafe(lambda: self._spawn(self._drain()))

    async def _drain(self) -> None:
        state = self.state
        engine = state.engine
        if state.phase is Phase.STARTING or engine is None:
            state.phase = Phase.STOPPED
            self._server.should_exit = True
            return
        state.phase = Phase.DRAINING
        timeout = self.launch.shutdown_timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if engine.num_open_channels:
            logger.info(
                "shutting down: waiting up to %.0f s for %d in-flight request(s)",
                timeout,
                engine.num_open_channels,
            )
        while engine.num_open_channels and loop.time() < deadline and engine.dead is None:
            await asyncio.sleep(0.05)
        if engine.num_open_channels:
            logger.warning(
                "shutdown timeout: aborting %d unfinished request(s)", engine.num_open_channels
            )
        state.phase = Phase.STOPPED
        await engine.shutdown()
        # Let the aborted requests write their error responses before uvicorn closes.
        for _ in range(40):
            if not engine.num_open_channels:
                break
            await asyncio.sleep(0.05)
        self._server.should_exit = True


def bind_socket(
    host: str, port: int, *, reuse_port: bool = False, listen: bool = True
) -> socket.socket:
    """A TCP socket (port 0: a free one), bound before the model loads, listening unless
    ``listen=False``. ``reuse_port``: several processes bind the same port
    (``SO_REUSEPORT``) and the kernel spreads new connections evenly over those listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    if listen:
        sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def listen_socket(host: str, port: int, **kwargs: Any) -> socket.socket:
    """``bind_socket`` for a server the user started: bound before the model loads; a port that cannot be taken is a
    ``ConfigError`` that says why and what to do."""
    import errno

    from engine.config import ConfigError

    try:
        return bind_socket(host, port, **kwargs)
    except socket.gaierror as e:
        raise ConfigError(
            f"cannot listen on --host {host}: the address does not resolve ({e.strerror}); "
            "use an IP address of this machine, 127.0.0.1, or 0.0.0.0 for every interface"
        ) from e
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            why = "another process is already listening there"
            fix = f"stop it, or choose a free port with --port (e.g. --port {port + 1})"
        elif e.errno == errno.EACCES:
            why = "permission denied (ports below 1024 need privileges)"
            fix = "choose a port of 1024 or more with --port"
        elif e.errno == errno.EADDRNOTAVAIL:
            why = "that address is not one of this machine's"
            fix = "use an address of this machine with --host, or 0.0.0.0 for every interface"
        else:
            why, fix = e.strerror or str(e), "check --host and --port"
        raise ConfigError(f"cannot listen on {host}:{port}: {why}; {fix}") from e
