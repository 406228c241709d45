"""What the executors whose workers live in other processes share (``mp`` and ``ray``).

The engine process holds no model: it encodes each step (``engine.executor.step_codec``),
broadcasts it to every worker (``engine.executor.messaging``) and waits for the results of the
reporting rank. Start-up is a handful of RPCs answered by every rank. A subclass starts the
workers (``_start_workers``), watches them (calling ``_worker_died`` when one is gone) and stops
them (``_stop_workers``).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.executor import messaging
from engine.executor.base import Executor, WorkerFailedError
from engine.executor.step_codec import StepEncoder
from engine.executor.worker import WorkerSpec

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.model_runner import RunnerOutput
    from engine.platforms.interface import Platform

logger = logging.getLogger(__name__)

# Seconds the workers get to start (import torch, load plugins) and connect.
START_TIMEOUT_S = 300.0
# Seconds a rank's error waits for news of another rank's death, its likely cause.
_CAUSE_GRACE_S = 0.3


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message already says what to fix (a bad model or configuration, a
    plugin problem): raised during start-up by a worker, they reach the user as they are."""
    from engine.errors import PluginError

    return (ValueError, PluginError)


class _Pending:
    """A launched step: its id (results come back in launch order)."""

    __slots__ = ("step_id",)

    def __init__(self, step_id: int) -> None:
        self.step_id = step_id


class RemoteExecutor(Executor):
    """Workers in other processes, one per rank; see the module docstring."""

    #: bind the channels on this address (None: ipc:// sockets, workers on this host)
    channel_host: str | None = None

    def __init__(
        self, config: EngineConfig, platform: type[Platform], attn_backend_cls: type
    ) -> None:
        self.config = config
        self.platform = platform
        self.attn_backend_cls = attn_backend_cls
        self.world_size = config.parallel.world_size
        hf = config.model.hf_config
        self._vocab_size = int((getattr(hf, "text_config", None) or hf).vocab_size)
        self._encoder = StepEncoder(config.cache.block_size)
        self._results: dict[int, RunnerOutput] = {}
        self._rpc_ids = itertools.count()
        self._failure: WorkerFailedError | None = None
        self._failure_lock = threading.Lock()
        self._failure_callback: Callable[[], None] | None = None
        self._closed = False
        self._serving = False  # start-up done (the KV cache is allocated)
        self.workers: list[Any] = []
        self.channels = messaging.DriverChannels(self._channel_host())
        atexit.register(self.shutdown)  # workers stop in order when the engine's process ends
        try:
            t0 = time.perf_counter()
            self._start_workers(self._worker_specs())
            self.channels.wait_for_subscribers(
                self.world_size, START_TIMEOUT_S, check=self._check_early, what="workers"
            )
            t1 = time.perf_counter()
            self.workers = self.collective_rpc("init_device")
            t2 = time.perf_counter()
            loads = self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "%d %s workers: started in %.1f s, process groups in %.1f s, model loaded in %.1f s",
            self.world_size,
            self.name,
            t1 - t0,
            t2 - t1,
            time.perf_counter() - t2,
        )
        self.load_stats = loads  # per rank: checkpoint bytes offered and read (logged there)
        # Image inputs: every rank runs the vision tower (sharded like the text model) and
        # mirrors the scheduler's encoder cache; the step message carries the images.
        self.image_input_spec = loads[0].get("image_input_spec")
        self.dtype_bytes = int(loads[0].get("dtype_bytes") or 0)

    # ---- what subclasses provide -------------------------------------------------------------
    def _channel_host(self) -> str | None:
        return None

    def _prepare_workers(self) -> tuple[str, list[tuple[int, int]]]:
        """Where the workers go: the ``tcp://host:port`` at which rank 0 hosts
        torch.distributed's rendezvous, and each rank's ``(device index, workers on its
        host)``."""
        raise NotImplementedError

    def _start_workers(self, specs: list[WorkerSpec]) -> None:
        raise NotImplementedError

    def _stop_workers(self, timeout_s: float) -> None:
        raise NotImplementedError

    # ---- start-up ----------------------------------------------------------------------------
    def _worker_specs(self) -> list[WorkerSpec]:
        from engine.lazy_class import qualified_name

        init, placement = self._prepare_workers()
        backend = qualified_name(self.attn_backend_cls)
        return [
            WorkerSpec(
                config=self.config,
                rank=rank,
                local_rank=local_rank,
                local_world_size=local_world,
                dist_init_method=init,
                attn_backend=backend,
                step_address=self.channels.step_address,
                reply_address=self.channels.reply_address,
            )
            for rank, (local_rank, local_world) in enumerate(placement)
        ]

    def _check_early(self) -> None:
        early = self.channels.early_error
        if early is not None:
            self._raise_worker_error(early)
        self.check_health()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def device(self) -> Any:
        import torch

        return torch.device("cpu")  # seeds only: the workers make their own generators

    def kv_cache_groups(self) -> list[int | None]:
        windows: set[int | None] = set()
        for found in self.collective_rpc("kv_cache_windows"):
            windows.update(found)
        groups = self.collective_rpc("kv_cache_groups", sorted(windows, key=_window_key))
        return groups[0]

    def determine_num_blocks(self, max_model_len_fixed: bool = True) -> int:
        answers = set(self.collective_rpc("determine_num_blocks", max_model_len_fixed))
        assert len(answers) == 1, f"the ranks disagree on the KV-cache size: {answers}"
        num_blocks, max_model_len = answers.pop()
        if max_model_len != self.config.model.max_model_len:
            # A CPU cache too small for the model's context: the workers lowered it (and
            # logged why); the scheduler must not admit longer requests.
            self.config.model.max_model_len = max_model_len
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("allocate_kv_cache", num_blocks)
        self.num_blocks = num_blocks
        self._serving = True

    def capture_graphs(self) -> float | None:
        times = [t for t in self.collective_rpc("capture_graphs") if t is not None]
        return max(times) if times else None

    # ---- LoRA adapters ------------------------------------------------------------------------
    def add_lora(self, key: int, lora_request: Any) -> None:
        """Load a LoRA adapter on every rank (the engine's ``LoRARegistry`` calls this between
        steps). An adapter some rank cannot serve is dropped from every rank and raised here
        as the ``LoRAAdapterError`` that rank gave; the workers stay up."""
        from engine.lora.errors import LoRAAdapterError

        errors = [e for e in self.collective_rpc("add_lora", key, lora_request) if e]
        if errors:
            self.collective_rpc("remove_lora", key)
            message, param = errors[0]
            raise LoRAAdapterError(message, param)

    def remove_lora(self, key: int) -> None:
        self.collective_rpc("remove_lora", key)

    # ---- RPC ----------------------------------------------------------------------------------
    def collective_rpc(
        self, method: str, *args: Any, ranks: list[int] | None = None, **kwargs: Any
    ) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on the workers (every rank, or ``ranks``) and
        return their results in rank order. Only between steps."""
        self.check_health()
        rpc_id = next(self._rpc_ids)
        self.channels.broadcast(
            messaging.RPC, messaging.dumps((rpc_id, method, args, kwargs, ranks))
        )
        expected = set(range(self.world_size)) if ranks is None else set(ranks)
        replies: dict[int, Any] = {}
        while len(replies) < len(expected):
            kind, payload = self._receive()
            if kind == messaging.REPLY:
                got_id, rank, result = messaging.loads(payload)
                if got_id == rpc_id:
                    replies[rank] = result
            elif kind == messaging.OUTPUT:
                # A step still in flight (asynchronous scheduling; an adapter loaded by
                # add_request): keep its output for collect().
                step_id, out = messaging.loads(payload)
                self._results[step_id] = out
        return [replies[r] for r in sorted(replies)]

    # ---- steps --------------------------------------------------------------------------------
    def execute_async(
        self,
        sched_out: Any,
        sampling_rows: dict[str, Any],
        prompt_logprobs: dict[str, int] | None = None,
    ) -> _Pending:
        self.check_health()
        step_id, message = self._encoder.encode(sched_out, sampling_rows, prompt_logprobs)
        self.channels.broadcast(messaging.STEP, message)
        return _Pending(step_id)

    def collect(self, pending: _Pending) -> RunnerOutput:
        results = self._results
        while pending.step_id not in results:
            kind, payload = self._receive()
            if kind == messaging.OUTPUT:
                step_id, out = messaging.loads(payload)
                results[step_id] = out
        return results.pop(pending.step_id)

    def _receive(self) -> tuple[bytes, bytes]:
        """The next message from a worker; raises when a worker failed."""
        while True:
            self.check_health()
            got = self.channels.receive(1.0)
            if got is None:
                continue
            kind, payload = got
            if kind == messaging.ERROR:
                self._raise_worker_error(messaging.loads(payload))
            return kind, payload

    # ---- failure -----------------------------------------------------------------------------
    def _raise_worker_error(self, report: tuple) -> None:
        rank, _rpc_id, where, exc, text = report
        if rank < 0:  # the monitor's wake-up: the failure is already recorded
            self.check_health()
            raise WorkerFailedError(where)
        if exc is not None and isinstance(exc, _user_errors()) and not self._serving:
            # A start-up error with a message of its own (a bad model, a config no rank can
            # run): the user sees it as if the engine had raised it here.
            self._fail(WorkerFailedError(f"worker rank {rank} failed in {where}: {exc}"))
            raise exc
        detail = f"{exc!r}" if exc is not None else text.strip().splitlines()[-1]
        message = f"worker rank {rank} failed in {where}: {detail}"
        logger.error("worker rank %d failed in %s:\n%s", rank, where, text)
        # A rank whose peer died fails in its next collective, often before the monitor has
        # reported the death: give the death a moment to arrive, and name it as the cause.
        deadline = time.monotonic() + _CAUSE_GRACE_S
        while self._failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._failure is not None and f"rank {rank} " not in str(self._failure):
            raise WorkerFailedError(f"{self._failure} (then {message})")
        error = WorkerFailedError(message)
        self._fail(error)
        raise error

    def _worker_died(self, message: str) -> None:
        """A subclass's monitor saw a worker go (not during shutdown): fail, and push the
        failure into the engine's reply socket so that a waiting engine wakes now."""
        if self._closed:
            return
        self._fail(WorkerFailedError(message))
        try:
            sender = messaging.ReplySender(self.channels.context, self.channels.reply_address)
            sender.send(messaging.ERROR, messaging.dumps((-1, None, message, None, "")))
            sender.close()
        except Exception:  # noqa: BLE001 - the engine also checks its health every second
            pass

    def _fail(self, error: WorkerFailedError) -> None:
        with self._failure_lock:
            if self._failure is not None:
                return
            self._failure = error
            callback = self._failure_callback
        logger.error("%s; the engine stops", error)
        if callback is not None:
            try:
                callback()
            except Exception:  # noqa: BLE001 - a failing observer must not hide the failure
                logger.exception("executor failure callback raised")

    def check_health(self) -> None:
        failure = self._failure
        if failure is not None:
            raise WorkerFailedError(str(failure))

    def set_failure_callback(self, callback: Callable[[], None] | None) -> None:
        with self._failure_lock:
            self._failure_callback = callback
            failed = self._failure is not None
        if failed and callback is not None:
            callback()

    # ---- shutdown ----------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        start = time.monotonic()
        try:
            self.channels.broadcast(messaging.SHUTDOWN)
        except Exception:  # noqa: BLE001 - the workers are stopped below either way
            pass
        try:
            self._stop_workers(timeout_s)
        finally:
            self.channels.close()
        logger.info("workers stopped in %.2f s", time.monotonic() - start)


def _window_key(window: int | None) -> tuple[bool, int]:
    return (window is not None, window or 0)
