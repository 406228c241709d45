"""``engine serve --api-server-count N``: N HTTP front ends sharing one port and the cores.

One front-end process on a busy server spends its time on HTTP, tokenization,
detokenization and SSE encoding, all under one GIL; several of them share that work. The
command's process becomes a supervisor:

```
engine serve (supervisor: reserves the port, starts everything, forwards signals)
 ├── engine-core-0 .. engine-core-{D-1}      (--data-parallel-size D: the model, one each)
 └── api-server-0 .. api-server-{N-1}        (uvicorn + AsyncEngine, each binding the port)
```

On Linux every front end binds the port with ``SO_REUSEPORT`` (the supervisor holds it bound,
not listening, so that nothing else takes it) and the kernel spreads connections evenly over
them; elsewhere they share one listening socket inherited from the supervisor. Every front end
talks to every engine core (requests in over each core's PULL socket, outputs back on the front
end's own); requests go to a core by the front end's ``DataParallelRouter``.

Metrics: the front ends write their observations to files in a temporary
``PROMETHEUS_MULTIPROC_DIR`` and a scrape of any front end sums them (see
``engine.server.metrics``); the directory is removed when the server stops.

Signals: SIGTERM or SIGINT to the supervisor drains every front end (each refuses new requests
and finishes its in-flight ones, as a single server does), then the cores are stopped and the
supervisor exits 0. A second signal makes the front ends exit at once. A front end that fails
(an engine core died: it answered its requests with the error and exited 1) makes the others
stop too; the supervisor then exits 1.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("engine.server")


@dataclass
class FrontEndArgs:
    """What a front-end process needs (pickled to it at start)."""

    config: Any  # EngineConfig
    options: Any  # ServerOptions
    launch: Any  # LaunchOptions, with this front end's api_server_index and the port
    connection: Any  # CoreConnection
    inherited_fd: int | None = None  # the listening socket, where SO_REUSEPORT is not used


def _reuse_port_balances() -> bool:
    """Whether SO_REUSEPORT spreads connections over the listening sockets (Linux)."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def serve_multiprocess(config: Any, options: Any, launch: Any) -> int:
    """Run ``launch.api_server_count`` front ends and the engine cores; return the exit status."""
    from engine.engine_core.proc import EngineCoreProcesses
    from engine.engine_core.processes import spawn
    from engine.server.launcher import listen_socket
    from engine.server.metrics import MULTIPROC_ENV

    count = launch.api_server_count
    reuse_port = _reuse_port_balances()
    # Taken before anything starts: a port in use fails here, at once.
    guard = listen_socket(launch.host, launch.port, reuse_port=reuse_port, listen=not reuse_port)
    port = guard.getsockname()[1]
    metrics_dir = tempfile.mkdtemp(prefix="engine-metrics-")
    front_ends: list[Any] = []
    cores = None
    try:
        cores = EngineCoreProcesses(config, num_clients=count, log_level=launch.log_level)
        for index in range(count):
            args = FrontEndArgs(
                config,
                options,
                dataclasses.replace(launch, port=port, api_server_index=index),
                cores.connection(index),
                None if reuse_port else guard.fileno(),
            )
            front_ends.append(
                spawn(
                    f"api-server-{index}",
                    "engine.server.multiproc:run_front_end",
                    (args,),
                    env={MULTIPROC_ENV: metrics_dir},
                    pass_fds=() if reuse_port else (guard.fileno(),),
                )
            )
        logger.info(
            "started %d API servers and %d engine core(s) for http://%s:%d",
            count,
            len(cores.procs),
            launch.host,
            port,
        )
        return _supervise(front_ends)
    finally:
        for proc in front_ends:
            proc.stop(launch.shutdown_timeout + 10)
        if cores is not None:
            cores.stop()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        guard.close()


def _supervise(front_ends: list[Any]) -> int:
    """Wait for the front ends; forward SIGTERM/SIGINT to them; stop them all if one fails."""
    signals = 0
    stopping = False

    def forward(signum: int, frame: Any) -> None:
        nonlocal signals
        signals += 1
        for proc in front_ends:
            if proc.is_alive():
                try:
                    proc.popen.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            codes = [proc.returncode for proc in front_ends]
            if all(code is not None for code in codes):
                break
            if not stopping and any(code not in (None, 0) for code in codes):
                stopping = True  # one failed (an engine core died, or a crash): stop the rest
                failed = next(p for p in front_ends if p.returncode not in (None, 0))
                logger.error("%s %s; stopping the other API servers", failed.name,
                             failed.describe_exit())  # fmt: skip
                for proc in front_ends:
                    if proc.is_alive():
                        proc.popen.send_signal(signal.SIGTERM)
            time.sleep(0.05)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if all(code == 0 for code in codes):
        return 0
    return 2 if 2 in codes and not signals else 1


def run_front_end(args: FrontEndArgs) -> int:
    """A front-end process: one ``ApiServer`` on the shared port, a client of every core."""
    from engine.cli.args import configure_logging
    from engine.cli.main import format_error, is_user_error
    from engine.engine_core.async_client import AsyncMPClient
    from engine.engine_core.processes import set_shutdown_handler
    from engine.server.launcher import ApiServer, bind_socket

    launch = args.launch
    configure_logging(launch.log_level, f"[api {launch.api_server_index}]")
    if args.inherited_fd is not None:
        sock = socket.socket(fileno=args.inherited_fd)
    else:
        sock = bind_socket(launch.host, launch.port, reuse_port=True)
    server = ApiServer(
        lambda: AsyncMPClient(args.config, args.connection), args.options, launch, sock=sock
    )
    # The supervisor closing our stdin (or dying) drains us like a SIGTERM.
    set_shutdown_handler(server.request_shutdown, grace_s=launch.shutdown_timeout + 10)
    try:
        return server.run()
    except Exception as exc:
        if is_user_error(exc):
            if launch.api_server_index == 0:  # the same error in every front end: say it once
                print(format_error(exc), file=sys.stderr)
            return 2
        if launch.api_server_index == 0:
            logging.getLogger("engine.server").exception("API server failed")
        return 1
