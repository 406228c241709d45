"""The engine-core busy loop, and the engine-core process around it.

``CoreLoop`` drives an ``EngineCore``: it takes front-end messages from its inbox, runs a step
whenever there is work (sleeping on the inbox when there is none: an idle core burns no CPU),
and hands each front end one ``EngineCoreOutputs`` per step with that front end's outputs. It
answers every ``AddRequests`` with an ``AddResult`` before the next step, and sends its
``EngineStats`` with the outputs every ``stats_interval_s`` while busy and once more when it
goes idle. The same loop runs in an engine-core process (``run_engine_core``) and, for the
server's in-process mode and tests, in a thread (``engine.engine_core.async_client``).

``run_engine_core`` is the process: it binds a ZMQ PULL socket for its input (every front end
connects a PUSH to it; messages carry the sender's ``client_index``) and connects one PUSH per
front end to that front end's PULL. An input thread receives and decodes messages (and
compiles structured-output grammars, so a slow compile never stalls a step); the loop thread
encodes and sends outputs itself (about 40 us for 512 outputs: less than a hand-off to a
thread would cost). A failure while loading or stepping is reported to every front end
(``CoreFailed``) before the process exits non-zero.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.engine_core.messages import (
    AbortRequests,
    AddRequests,
    AddResult,
    AllFrontEndsReady,
    CoreFailed,
    CoreReady,
    EngineCoreOutputs,
    FinishSequences,
    FrontEndReady,
    GetStats,
    Shutdown,
    UtilityCall,
    request_error,
    run_utility,
)

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.5


class CoreLoop:
    """Runs an ``EngineCore`` until a ``Shutdown`` message; see the module docstring.

    ``send(client_index, message)`` delivers a message to one front end (called in the loop's
    thread); ``num_clients`` front ends are served.
    """

    def __init__(
        self,
        core: Any,
        send: Callable[[int, Any], None],
        *,
        engine_index: int = 0,
        num_clients: int = 1,
        stats_interval_s: float = STATS_INTERVAL_S,
    ) -> None:
        self.core = core
        self.send = send
        self.engine_index = engine_index
        self.num_clients = num_clients
        self.stats_interval_s = stats_interval_s
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._client_of: dict[str, int] = {}  # request id -> front end (several front ends)
        self._ready_clients: set[int] = set()
        self._stopping = False

    def run(self) -> None:
        """Serve until ``Shutdown``; an exception (a failed step, a model worker that died)
        propagates to the caller, who reports it."""
        core = self.core
        # A model worker that dies while the core is idle wakes the loop, whose health check
        # then raises (a busy core's step raises anyway).
        check_health = getattr(core, "check_health", None)
        register = getattr(core, "set_failure_callback", None)
        if check_health is not None and register is not None:
            register(lambda: self.inbox.put(check_health))
        last_stats = 0.0
        busy = False
        while True:
            idle = not core.has_unfinished_requests()
            if idle and busy:
                busy = False
                self._send_stats_to_all()  # the last word: what an idle core looks like
            self._process_inbox(block=idle)
            if self._stopping:
                return
            if not core.has_unfinished_requests():
                continue
            busy = True
            outputs = core.step()
            stats = None
            now = time.monotonic()
            if now - last_stats >= self.stats_interval_s:
                last_stats = now
                stats = core.get_stats()
            if outputs or stats is not None:
                self._send_outputs(outputs, stats)

    # ------------------------------------------------------------------ inbox
    def _process_inbox(self, block: bool) -> None:
        inbox = self.inbox
        messages = []
        if block:
            messages.append(inbox.get())
        while True:
            try:
                messages.append(inbox.get_nowait())
            except queue.Empty:
                break
        results: dict[int, AddResult] = {}
        core = self.core
        for msg in messages:
            if isinstance(msg, AddRequests):
                for req in msg.requests:
                    result = results.get(req.client_index)
                    if result is None:
                        result = results[req.client_index] = AddResult(
                            [], [], engine_index=self.engine_index
                        )
                    try:
                        core.add_request(req)
                    except Exception as e:  # noqa: BLE001 - a refused request, core intact
                        result.rejected.append(request_error(req.request_id, e))
                        continue
                    result.accepted.append(req.request_id)
                    if self.num_clients > 1:
                        self._client_of[req.request_id] = req.client_index
            elif isinstance(msg, AbortRequests):
                core.abort_requests(msg.request_ids)
                for rid in msg.request_ids:
                    self._client_of.pop(rid, None)
            elif isinstance(msg, FinishSequences):
                core.finish_sequences(msg.sequences)
                if self.num_clients > 1:
                    for rid, _ in msg.sequences:
                        if rid not in core._requests:
                            self._client_of.pop(rid, None)
            elif isinstance(msg, FrontEndReady):
                self._ready_clients.add(msg.client_index)
                if len(self._ready_clients) == self.num_clients:
                    for client in range(self.num_clients):
                        self.send(client, AllFrontEndsReady())
            elif isinstance(msg, GetStats):
                self.send(
                    msg.client_index, EngineCoreOutputs([], self.engine_index, core.get_stats())
                )
            elif isinstance(msg, UtilityCall):
                self.send(msg.client_index, run_utility(core, msg, self.engine_index))
            elif isinstance(msg, Shutdown) or msg is None:
                self._stopping = True
            elif callable(msg):  # in process only: a barrier (``sync``) or a health check
                msg()
        for client_index, result in results.items():
            self.send(client_index, result)

    def stop(self) -> None:
        """Ask the loop to return (thread-safe)."""
        self.inbox.put(Shutdown())

    def sync(self, timeout: float = 30.0) -> bool:
        """Block until the loop has handled every message put before this call (a barrier,
        for in-process callers: aborts and stops sent so far have freed their blocks)."""
        done = threading.Event()
        self.inbox.put(done.set)
        return done.wait(timeout)

    # ------------------------------------------------------------------ outputs
    def _send_outputs(self, outputs: list[Any], stats: Any) -> None:
        if self.num_clients == 1:
            self.send(0, EngineCoreOutputs(outputs, self.engine_index, stats))
            return
        by_client: dict[int, list[Any]] = {}
        client_of = self._client_of
        live = self.core._requests
        for o in outputs:
            client = client_of.get(o.request_id)
            if client is None:
                continue
            by_client.setdefault(client, []).append(o)
            if o.finish_reason is not None and o.request_id not in live:
                del client_of[o.request_id]
        for client in range(self.num_clients) if stats is not None else by_client:
            self.send(
                client, EngineCoreOutputs(by_client.get(client, []), self.engine_index, stats)
            )

    def _send_stats_to_all(self) -> None:
        stats = self.core.get_stats()
        for client in range(self.num_clients):
            self.send(client, EngineCoreOutputs([], self.engine_index, stats))


# ------------------------------------------------------------------------- the process
@dataclass
class CoreProcessArgs:
    """What an engine-core process needs (pickled to it once, at start)."""

    config: Any  # EngineConfig
    engine_index: int
    input_address: str
    output_addresses: list[str]
    log_level: str = "info"


def ready_message(core: Any, engine_index: int, load_seconds: float) -> CoreReady:
    """What the front end learns of the core once it is loaded."""
    config = core.config
    runner = core.runner
    backend = getattr(getattr(runner, "attn_backend_cls", None), "name", "")
    return CoreReady(
        engine_index=engine_index,
        pid=os.getpid(),
        model=str(config.model.model),
        max_model_len=int(config.model.max_model_len),
        vocab_size=int(runner.vocab_size),
        eos_token_ids=list(core.eos_token_ids),
        dtype=str(config.model.dtype),
        platform=str(config.platform),
        served_model_name=config.model.served_model_name,
        default_sampling=dict(config.model.default_sampling or {}),
        block_size=int(config.cache.block_size),
        num_blocks=int(getattr(runner, "num_blocks", 0) or 0),
        enable_prefix_caching=bool(config.cache.enable_prefix_caching),
        max_num_seqs=int(config.scheduler.max_num_seqs),
        max_num_batched_tokens=int(config.scheduler.max_num_batched_tokens),
        max_logprobs=int(config.max_logprobs),
        async_scheduling=bool(config.scheduler.async_scheduling),
        attention_backend=str(backend),
        load_seconds=load_seconds,
        image_input_spec=getattr(core, "image_input_spec", None),
        implementation=config.model.implementation,
        runner_type=getattr(config.model, "runner_type", "generate"),
        pooler_config=_pooler_fields(getattr(config.model, "pooler_config", None)),
    )


def _pooler_fields(cfg: Any) -> dict[str, Any] | None:
    import dataclasses

    return dataclasses.asdict(cfg) if cfg is not None else None


def failure_message(engine_index: int, exc: BaseException) -> CoreFailed:
    from engine.config import ConfigError
    from engine.errors import PluginError

    user = isinstance(exc, (ConfigError, PluginError))
    kernels = sys.modules.get("engine.kernels.registry")
    if kernels is not None and isinstance(exc, kernels.KernelError):
        user = True
    return CoreFailed(
        engine_index=engine_index,
        message=str(exc) if user else f"{type(exc).__name__}: {exc}",
        kind=type(exc).__name__,
        user_error=user,
        traceback="" if user else traceback.format_exc(),
    )


def run_engine_core(args: CoreProcessArgs) -> int:
    """The engine-core process: load, report ready, serve until shut down."""
    import zmq

    from engine.engine_core.messages import Codec
    from engine.engine_core.processes import set_shutdown_handler
    from engine.engine_core.transport import make_socket

    logging.basicConfig(  # the format of engine serve's lines (engine.cli.serve)
        level=getattr(logging, args.log_level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s %(name)s [core {args.engine_index}]: %(message)s",
        datefmt="%H:%M:%S",
    )
    index = args.engine_index
    codec = Codec()
    ctx = zmq.Context(io_threads=1)
    outputs = [make_socket(ctx, zmq.PUSH, addr, bind=False) for addr in args.output_addresses]
    inputs = make_socket(ctx, zmq.PULL, args.input_address, bind=True)
    encode = codec.encoder.encode

    def send(client: int, message: Any) -> None:
        outputs[client].send(encode(message), copy=False)

    def exit_with(code: int) -> int:
        for sock in outputs:
            sock.close(linger=2000)  # deliver what was sent, then go
        os._exit(code)

    loop: CoreLoop | None = None
    set_shutdown_handler(lambda: loop.stop() if loop is not None else os._exit(0))
    start = time.perf_counter()
    try:
        from engine.engine_core.core import EngineCore

        core = EngineCore.from_config(args.config)
    except BaseException as e:  # noqa: BLE001 - reported to the front ends, then exit
        failed = failure_message(index, e)  # the front ends report it, traceback included
        for client in range(len(outputs)):
            send(client, failed)
        return exit_with(2 if failed.user_error else 1)

    loop = CoreLoop(core, send, engine_index=index, num_clients=len(outputs))
    ready = ready_message(core, index, time.perf_counter() - start)
    for client in range(len(outputs)):
        send(client, ready)

    def receive() -> None:
        decode = codec.to_core.decode
        while True:
            try:
                msg = decode(inputs.recv(copy=False).buffer)
            except zmq.ZMQError:
                return
            except Exception:  # noqa: BLE001 - a malformed message is a bug in a front end
                logger.exception("engine core %d: dropping an undecodable message", index)
                continue
            if isinstance(msg, AddRequests):
                _precompile(core, msg)
            loop.inbox.put(msg)

    threading.Thread(target=receive, name="core-input", daemon=True).start()
    try:
        loop.run()
    except BaseException as e:  # noqa: BLE001 - reported to the front ends, then exit
        logger.exception("engine core %d failed", index)
        failed = failure_message(index, e)
        for client in range(len(outputs)):
            send(client, failed)
        _stop_workers(core)
        return exit_with(1)
    _stop_workers(core)
    return exit_with(0)


def _stop_workers(core: Any) -> None:
    """Stop the core's model-worker processes (tensor/pipeline parallelism), if any."""
    try:
        core.shutdown()
    except Exception:  # noqa: BLE001 - exiting anyway; the workers watch this process
        logger.exception("stopping the model workers failed")


def _precompile(core: Any, msg: AddRequests) -> None:
    """Compile the grammars of structured-output requests here, on the input thread, so that
    the loop thread finds them in the grammar cache. A constraint that does not compile is
    left for ``add_request`` to refuse."""
    for req in msg.requests:
        constraint = req.sampling_params.structured_outputs
        if constraint is not None:
            try:
                core.structured_outputs.compile(constraint)
            except Exception:  # noqa: BLE001 - refused by add_request, with its message
                pass


# ------------------------------------------------------------------------- starting cores
def data_parallel_env(config: Any, dp: int) -> list[dict[str, str]]:
    """The environment of each of ``dp`` engine-core processes: its own ``world_size``
    devices (tensor x pipeline ranks; one without them) where the platform has a
    device-selection variable (``CUDA_VISIBLE_DEVICES``), the CPU's threads split evenly on
    the CPU."""
    if dp == 1:
        return [{}]
    from engine.config import ConfigError
    from engine.plugins import PluginManager

    requested = None if config.platform == "auto" else config.platform
    platform = PluginManager.from_env().resolve_platform(requested)
    var = platform.device_control_env_var
    if var:
        visible = os.environ.get(var)
        if visible is not None:
            devices = [d.strip() for d in visible.split(",") if d.strip()]
        else:
            devices = [str(i) for i in range(platform.device_count())]
        per_core = int(config.parallel.world_size)
        if len(devices) < dp * per_core:
            layout = "one" if per_core == 1 else f"{per_core} (tensor x pipeline ranks)"
            raise ConfigError(
                f"data_parallel_size={dp} needs {dp * per_core} {platform.name} devices, "
                f"{layout} per engine core; {len(devices)} are visible ({var}={visible!r})"
            )
        return [{var: ",".join(devices[i * per_core : (i + 1) * per_core])} for i in range(dp)]
    if platform.device_type == "cpu":
        total = int(os.environ.get("OMP_NUM_THREADS") or 0) or _usable_cpus()
        per_core = str(max(1, total // dp))
        return [{"OMP_NUM_THREADS": per_core} for _ in range(dp)]
    raise ConfigError(
        f"platform {platform.name} has no device-selection variable "
        "(Platform.device_control_env_var), so it cannot run data_parallel_size > 1"
    )


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass
class CoreConnection:
    """How one front end reaches the engine cores (picklable: handed to front-end processes)."""

    client_index: int
    input_addresses: list[str]  # one per engine core
    output_address: str  # this front end's
    pids: list[int]  # the cores', to watch them
    num_clients: int = 1  # front ends in all


class EngineCoreProcesses:
    """The engine-core processes of one server or ``LLM``: one per data-parallel rank,
    serving ``num_clients`` front ends. ``stop()`` (also run at interpreter exit) ends them."""

    def __init__(self, config: Any, *, num_clients: int = 1, log_level: str = "info") -> None:
        import atexit

        from engine.engine_core.processes import spawn
        from engine.engine_core.transport import Endpoints

        dp = config.parallel.data_parallel_size
        envs = data_parallel_env(config, dp)
        self.endpoints = Endpoints()
        self.num_clients = num_clients
        outputs = [self.endpoints.client_output(j) for j in range(num_clients)]
        self.input_addresses = [self.endpoints.core_input(i) for i in range(dp)]
        self.procs = []
        try:
            for i in range(dp):
                args = CoreProcessArgs(config, i, self.input_addresses[i], outputs, log_level)
                self.procs.append(
                    spawn(
                        f"engine-core-{i}",
                        "engine.engine_core.proc:run_engine_core",
                        (args,),
                        env=envs[i],
                    )
                )
        except BaseException:
            self.stop()
            raise
        atexit.register(self.stop)

    def connection(self, client_index: int) -> CoreConnection:
        return CoreConnection(
            client_index,
            list(self.input_addresses),
            self.endpoints.client_output(client_index),
            [p.pid for p in self.procs],
            self.num_clients,
        )

    def stop(self, timeout: float = 10.0) -> None:
        """Ask every core to exit, wait, then terminate or kill (idempotent)."""
        for proc in self.procs:
            proc.request_stop()
        for proc in self.procs:
            proc.stop(timeout)
        self.endpoints.close()
