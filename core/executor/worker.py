"""One rank of a model replica in its own process: process groups, a ``ModelRunner``, the loop.

A ``Worker`` joins the replica's process groups (``engine.executor.process_groups``), builds
the platform, kernels, attention backend and ``ModelRunner`` for its device from the engine's
config, and loads its shard of the model. ``WorkerLoop`` then serves the engine's broadcast
(``engine.executor.messaging``): RPCs during start-up (every rank answers), then one message per
scheduled step (``engine.executor.step_codec``), which every rank runs; the rank that reports
(tensor-parallel rank 0 of the last pipeline stage) sends the step's results back from a sender
thread, so the next step is launched while the device still works on this one.

Every rank of the last stage samples, with the same generators and the same logits (the LM
head gathers them on every rank), so the tokens of a step are on every rank's device without
another collective: each rank feeds them back into the next step itself (asynchronous
scheduling), exactly as a single device does.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.executor import messaging
from engine.executor.step_codec import StepDecoder

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner
    from engine.parallel import ParallelContext

logger = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """What a worker process is started with (pickled to it)."""

    config: EngineConfig
    rank: int
    local_rank: int  # the device index on its host
    local_world_size: int  # workers on its host (CPU threads are split among them)
    dist_init_method: str  # tcp://host:port of rank 0's rendezvous
    attn_backend: str  # "module:Class" of the attention backend the engine selected
    step_address: str
    reply_address: str

    @property
    def tp_size(self) -> int:
        return self.config.parallel.tensor_parallel_size

    @property
    def pp_size(self) -> int:
        return self.config.parallel.pipeline_parallel_size


class Worker:
    """The RPC surface of one rank (methods called by name from the executor)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.parallel: ParallelContext | None = None
        self.runner: ModelRunner | None = None
        self._digest: Any = None
        self._fail_next_step = False
        self._timer: CollectiveTimer | None = None
        self._step_seconds = 0.0

    # ---- start-up -------------------------------------------------------------------------
    def init_device(self) -> dict[str, Any]:
        """Pick the device, split the CPU threads, join the process groups. Returns where
        this rank runs (for logs and tests)."""
        import torch

        from engine.executor.process_groups import init_parallel_context
        from engine.plugins import PluginManager

        spec, config = self.spec, self.spec.config
        self.plugins = PluginManager.from_env()
        self.platform = self.plugins.resolve_platform(config.platform)
        device = self.platform.torch_device(spec.local_rank)
        if device.type == "cpu":
            from engine.cpu_threads import available_physical_cores

            if config.cpu_threads is not None:  # --cpu-threads: each rank's team
                torch.set_num_threads(config.cpu_threads)
            elif "OMP_NUM_THREADS" not in os.environ:  # each rank its share of the cores
                cores, _ = available_physical_cores()
                torch.set_num_threads(max(1, cores // spec.local_world_size))
        else:
            module = getattr(torch, device.type, None)
            if module is not None and hasattr(module, "set_device"):
                module.set_device(device)
        # Every rank samples the same tokens (see the module docstring): the same seed for the
        # unseeded draws, and the same sequence of random ops on every rank.
        torch.manual_seed(config.model.seed)
        self.device = device
        self.parallel = init_parallel_context(
            self.plugins,
            self.platform,
            spec.rank,
            spec.tp_size,
            spec.pp_size,
            spec.dist_init_method,
            device,
            enable_expert_parallel=config.parallel.enable_expert_parallel,
        )
        return {"rank": self.rank, "pid": os.getpid(), "device": str(device)}

    def load_model(self) -> dict[str, Any]:
        """Build this rank's runner and load its shard; returns the checkpoint bytes read."""
        import importlib

        from engine.model_runner import ModelRunner
        from engine.models.registry import ModelRegistry
        from engine.quantization.resolve import resolve_quantization
        from engine.sampler import Sampler

        config = self.spec.config
        module, _, name = self.spec.attn_backend.partition(":")
        backend_cls = getattr(importlib.import_module(module), name)
        kernels = self.plugins.kernel_registry().resolve(self.platform.name)
        hf = config.model.hf_config
        vocab = (getattr(hf, "text_config", None) or hf).vocab_size
        sampler = Sampler(vocab, self.device, argmax=kernels.argmax)
        # The same method the engine process resolved (same flags, checkpoint and platform).
        quant_config = resolve_quantization(config, hf, self.platform, kernels, self.plugins)
        self.runner = ModelRunner(
            config,
            self.platform,
            kernels,
            backend_cls,
            sampler,
            model_registry=ModelRegistry.with_plugins(self.plugins),
            parallel=self.parallel,
            device_index=self.spec.local_rank,
            quant_config=quant_config,
        )
        # The ranks on this host share its memory (what a CPU KV cache may take of it).
        self.runner.ranks_on_host = self.spec.local_world_size
        self.runner.load_model()
        stats = self.runner.load_stats
        return {
            "rank": self.rank,
            "bytes_offered": stats.offered,
            "bytes_read": stats.read,
            # How the model takes images (None: text only) and its embeddings' element size.
            "image_input_spec": self.runner.image_input_spec,
            "dtype_bytes": next(self.runner.model.parameters()).element_size(),
        }

    def kv_cache_windows(self) -> list[int | None]:
        return sorted(self._runner.kv_cache_windows(), key=lambda w: (w is not None, w or 0))

    def kv_cache_groups(self, windows: list[int | None]) -> list[int | None]:
        return self._runner.kv_cache_groups(windows)

    def determine_num_blocks(self, max_model_len_fixed: bool = True) -> tuple[int, int]:
        """``(blocks, max_model_len)``: this rank's KV-cache blocks and the context they serve
        (a CPU cache may lower an unset ``max_model_len``), then the smallest of each over
        every rank (an all-reduce MIN): one scheduler hands the same block ids to every rank,
        and each rank's smallest cache holds a request of the smallest context."""
        import torch

        runner = self._runner
        mine = runner.determine_num_blocks(max_model_len_fixed=max_model_len_fixed)
        world = self.parallel.world if self.parallel is not None else None
        if world is None or world.world_size == 1:
            return mine, runner.max_model_len
        value = torch.tensor([mine, runner.max_model_len], dtype=torch.int64, device=self.device)
        blocks, max_model_len = (int(v) for v in world.all_reduce(value, op="min").tolist())
        runner.config.model.max_model_len = max_model_len
        return blocks, max_model_len

    def allocate_kv_cache(self, num_blocks: int) -> int:
        self._runner.allocate_kv_cache(num_blocks)
        return self._runner.bytes_per_block() * num_blocks

    def capture_graphs(self) -> float | None:
        return self._runner.capture_graphs()

    def add_lora(self, key: int, lora_request: Any) -> tuple[str, str | None] | None:
        """Load a LoRA adapter into this rank's slots-to-be (each rank reads the PEFT files and
        keeps its shard of A/B). An adapter that cannot be served comes back as
        ``(message, param)`` instead of failing the worker; the executor raises it."""
        from engine.lora.errors import LoRAAdapterError

        try:
            self._runner.add_lora(key, lora_request)
        except LoRAAdapterError as exc:
            return str(exc), exc.param
        return None

    def remove_lora(self, key: int) -> None:
        self._runner.remove_lora(key)

    def describe(self) -> dict[str, Any]:
        """Where this rank runs and what it holds (tests, ``engine`` logs)."""
        runner = self._runner
        assert self.parallel is not None and runner.model is not None
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "tp_rank": self.parallel.tp_rank,
            "pp_rank": self.parallel.pp_rank,
            "num_attention_layers": len(runner.model.attention_layers()),
            "num_blocks": runner.num_blocks,
            "graphs": None if runner.graphs is None else runner.graphs.sizes,
            "parameters": {name: tuple(p.shape) for name, p in runner.model.named_parameters()},
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's parameters on the host (tests compare them with the checkpoint)."""
        runner = self._runner
        assert runner.model is not None
        return {name: p.detach().cpu() for name, p in runner.model.named_parameters()}

    def record_samples(self, enable: bool = True) -> None:
        """Start (or stop) hashing every token this rank samples (tests check that the ranks
        of the last stage agree; this waits for each step's tokens, so only for tests)."""
        self._digest = hashlib.sha256() if enable else None

    def samples_digest(self) -> str | None:
        """The hash of every token sampled since ``record_samples`` (None off the last
        stage, which samples nothing)."""
        if self._digest is None or self.parallel is None or not self.parallel.is_last_stage:
            return None
        return self._digest.hexdigest()

    def num_images_encoded(self) -> int:
        """Images this rank's vision tower encoded (0 for a text model)."""
        mm = getattr(self._runner, "mm", None)
        return mm.num_encoded if mm is not None else 0

    def ping(self) -> int:
        return self.rank

    def time_collectives(self, enable: bool = True) -> None:
        """Start (or stop) timing this rank's collectives (benchmarks: see
        ``collective_stats``). On the CPU the calls block, so their wall time is the time;
        on a GPU each call is bracketed by CUDA events (eager steps only: a replayed graph
        runs no Python)."""
        if self._timer is not None:
            self._timer.uninstall()
            self._timer = None
        if enable and self.parallel is not None:
            self._timer = CollectiveTimer(self.device)
            self._timer.install(self.parallel.tp, self.parallel.pp)

    def collective_stats(self) -> dict[str, Any]:
        """``{op: {"calls": n, "seconds": s}}`` since ``time_collectives`` (or the last call),
        and ``"step_seconds"``: this rank's wall time in steps (launch to results)."""
        stats = self._timer.take() if self._timer is not None else {}
        stats["step_seconds"], self._step_seconds = self._step_seconds, 0.0
        return stats

    def inject_step_failure(self) -> None:
        """Make the next step raise on this rank (tests of the failure path)."""
        self._fail_next_step = True

    @property
    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("load_model() first")
        return self.runner

    # ---- steps ----------------------------------------------------------------------------
    def execute(self, decoder: StepDecoder, message: memoryview | bytes) -> tuple[int, Any]:
        """Run one step message; returns ``(step_id, PendingStep)``."""
        if self._fail_next_step:
            raise RuntimeError(f"a failure injected into rank {self.rank}'s step")
        start = time.perf_counter() if self._timer is not None else 0.0
        step = decoder.decode(message)
        pending = self._runner.execute_async(
            step.sched_out, step.sampling_rows, step.prompt_logprobs
        )
        decoder.after_step(step)
        if self._timer is not None:
            self._runner.collect(pending)  # timing waits for the step (benchmarks only)
            self._step_seconds += time.perf_counter() - start
        if self._digest is not None and self.parallel is not None and self.parallel.is_last_stage:
            out = self._runner.collect(pending)
            for rid in sorted(out.sampled):
                self._digest.update(f"{rid}:{out.sampled[rid]};".encode())
        return step.step_id, pending


class CollectiveTimer:
    """Times the collectives of some communicators by wrapping their methods in place (every
    layer holding the communicator sees the wrapper); ``uninstall`` restores them."""

    OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv")

    def __init__(self, device: Any) -> None:
        self.cuda = getattr(device, "type", "cpu") == "cuda"
        self._installed: list[tuple[Any, str]] = []
        self._seconds: dict[str, float] = {}
        self._calls: dict[str, int] = {}
        self._events: list[tuple[str, Any, Any]] = []

    def install(self, *communicators: Any) -> None:
        seen = set()
        for comm in communicators:
            if id(comm) in seen or comm.world_size == 1:
                continue
            seen.add(id(comm))
            for op in self.OPS:
                setattr(comm, op, self._wrap(op, getattr(comm, op)))
                self._installed.append((comm, op))

    def uninstall(self) -> None:
        for comm, op in self._installed:
            comm.__dict__.pop(op, None)
        self._installed = []

    def _wrap(self, op: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._calls[op] = self._calls.get(op, 0) + 1
            if self.cuda:
                import torch

                begin = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                begin.record()
                out = fn(*args, **kwargs)
                end.record()
                self._events.append((op, begin, end))
                return out
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self._seconds[op] = self._seconds.get(op, 0.0) + time.perf_counter() - start
            return out

        return timed

    def take(self) -> dict[str, Any]:
        if self._events:
            self._events[-1][2].synchronize()
            for op, begin, end in self._events:
                self._seconds[op] = self._seconds.get(op, 0.0) + begin.elapsed_time(end) / 1e3
            self._events = []
        stats = {
            op: {"calls": n, "seconds": self._seconds.get(op, 0.0)} for op, n in self._calls.items()
        }
        self._seconds, self._calls = {}, {}
        return stats


class WorkerLoop:
    """Serves the engine's broadcast until shutdown (see the module docstring)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.worker = Worker(spec)
        self.channels = messaging.WorkerChannels(spec.step_address, spec.reply_address)
        self._results: queue.Queue[Any] = queue.Queue()
        self._sender: threading.Thread | None = None
        self._reported = False

    def run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - reported to the engine, then this rank exits
            if not self._reported:
                self._report(e, "running a step")
            raise
        finally:
            self._stop_sender()
            self.channels.close()
            from engine.executor.process_groups import destroy_process_groups

            try:
                destroy_process_groups()
            except Exception:  # noqa: BLE001 - leaving anyway
                pass

    def _serve(self) -> None:
        decoder: StepDecoder | None = None
        worker = self.worker
        while True:
            tag, payload = self.channels.receive()
            if tag == messaging.STEP:
                if decoder is None:
                    decoder = StepDecoder(worker.device)
                    # Start-up is over: keep the garbage collector from re-scanning the model,
                    # plugins and imported modules on every collection (as the server does).
                    gc.collect()
                    gc.freeze()
                step_id, pending = worker.execute(decoder, payload)
                if worker.parallel is not None and worker.parallel.is_output_rank:
                    self._ensure_sender()
                    self._results.put((step_id, pending))
            elif tag == messaging.RPC:
                rpc_id, method, args, kwargs, ranks = messaging.loads(payload)
                if ranks is not None and worker.rank not in ranks:
                    continue
                try:
                    result = getattr(worker, method)(*args, **kwargs)
                except BaseException as e:  # noqa: BLE001 - the engine re-raises it
                    self._report(e, f"{method}()", rpc_id)
                    raise
                self.channels.replies.send(
                    messaging.REPLY, messaging.dumps((rpc_id, worker.rank, result))
                )
            elif tag == messaging.SHUTDOWN:
                return

    def _report(self, exc: BaseException, where: str, rpc_id: int | None = None) -> None:
        """Tell the engine this rank failed (the exception itself when it pickles)."""
        self._reported = True
        text = "".join(traceback.format_exception(exc))
        try:
            payload = messaging.dumps((self.worker.rank, rpc_id, where, exc, text))
        except Exception:  # noqa: BLE001 - an exception that does not pickle: send its text
            payload = messaging.dumps((self.worker.rank, rpc_id, where, None, text))
        try:
            self.channels.replies.send(messaging.ERROR, payload)
        except Exception:  # noqa: BLE001 - the engine learns from the process exit instead
            pass

    # The output rank collects each step on a second thread, so the main thread can launch
    # the next step while the device still computes this one.
    def _ensure_sender(self) -> None:
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_results, name="results", daemon=True)
            self._sender.start()

    def _send_results(self) -> None:
        sender = messaging.ReplySender(self.channels.ctx, self.channels.reply_address)
        runner = self.worker._runner
        try:
            while True:
                item = self._results.get()
                if item is None:
                    return
                step_id, pending = item
                out = runner.collect(pending)
                sender.send(messaging.OUTPUT, messaging.dumps((step_id, out)))
        except BaseException as e:  # noqa: BLE001 - this rank cannot report any more: exit
            text = "".join(traceback.format_exception(e))
            sender.send(
                messaging.ERROR,
                messaging.dumps((self.worker.rank, None, "collecting a step", None, text)),
            )
            sender.close()
            os._exit(1)
        finally:
            sender.close()

    def _stop_sender(self) -> None:
        if self._sender is not None:
            self._results.put(None)
            self._sender.join(timeout=5)


def run_worker(spec: WorkerSpec) -> None:
    """A worker's whole life: serve the engine until it says shutdown (or fail loudly)."""
    logging.basicConfig(
        level=logging.INFO, format=f"(rank {spec.rank}) %(levelname)s %(name)s: %(message)s"
    )
    WorkerLoop(spec).run()
