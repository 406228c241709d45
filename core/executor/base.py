"""The ``Executor`` interface: what the engine asks of the workers of one model replica.

The engine loop (``engine.engine_core.core.EngineCore``) schedules; the executor runs each
scheduled step on the replica's workers (one per device: ``tensor_parallel_size x
pipeline_parallel_size`` ranks) and returns the sampled tokens. Three implementations, chosen by
``ParallelConfig.distributed_executor_backend``:

* ``uni`` (``UniProcExecutor``): one ``ModelRunner`` in the engine's own process, world size 1;
  the engine calls the runner's ``execute_async`` / ``collect`` directly.
* ``mp`` (``MultiprocExecutor``): one spawned worker process per rank on this host.
* ``ray`` (``RayExecutor``): one Ray actor per rank, in a placement group on one or several
  hosts.

Start-up runs the same sequence on every executor (``engine.runtime`` drives it):
``kv_cache_groups()``, ``determine_num_blocks()`` (the smallest over the ranks),
``allocate_kv_cache(n)``, ``capture_graphs()``. Then one ``execute_async`` / ``collect`` pair per
step; with pipeline parallelism up to ``max_concurrent_batches`` steps are in flight. A worker
that dies or raises makes the executor failed: ``check_health()`` and every later call raise
``WorkerFailedError``, and the callback given to ``set_failure_callback`` is called once, from
the thread that noticed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.model_runner import RunnerOutput
    from engine.scheduler_output import SchedulerOutput


class WorkerFailedError(RuntimeError):
    """A worker of the model replica died or raised: the engine cannot run steps any more.
    The message names the rank, its process and what happened to it."""


class Executor(ABC):
    """Runs the steps of one model replica on its workers (see the module docstring)."""

    #: the ``--distributed-executor-backend`` name
    name: str = "abstract"

    config: EngineConfig
    attn_backend_cls: Any
    num_blocks: int = 0
    #: captured decode graphs of an in-process runner (None elsewhere)
    graphs: Any = None

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """The model's vocabulary size."""

    @property
    @abstractmethod
    def device(self) -> Any:
        """The torch device on which the engine creates the requests' seeded generators (the
        workers' own generators start from their seeds)."""

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine may keep in flight: one per pipeline stage."""
        return self.config.parallel.pipeline_parallel_size

    # ---- start-up ----------------------------------------------------------------------------
    @abstractmethod
    def kv_cache_groups(self) -> list[int | None]:
        """One KV-cache group per distinct sliding window of the whole model."""

    @abstractmethod
    def determine_num_blocks(self, max_model_len_fixed: bool = True) -> int:
        """KV-cache blocks every rank can hold (the smallest over the ranks). On a CPU an
        unset ``max_model_len`` (``max_model_len_fixed=False``) may be lowered to what the
        cache holds: the ranks agree on the smallest, and ``config.model.max_model_len`` of
        the engine's config is set to it."""

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def capture_graphs(self) -> float | None:
        """Capture decode graphs where the platform allows; the seconds taken or None."""

    # ---- steps -------------------------------------------------------------------------------
    @abstractmethod
    def execute_async(
        self,
        sched_out: SchedulerOutput,
        sampling_rows: dict[str, Any],
        prompt_logprobs: dict[str, int] | None = None,
    ) -> Any:
        """Launch a step (``ModelRunner.execute_async``'s contract); ``collect`` its handle."""

    @abstractmethod
    def collect(self, pending: Any) -> RunnerOutput:
        """Wait for a launched step's results (steps are collected in launch order)."""

    def execute(
        self,
        sched_out: SchedulerOutput,
        sampling_rows: dict[str, Any],
        prompt_logprobs: dict[str, int] | None = None,
    ) -> RunnerOutput:
        """Run one step to completion."""
        return self.collect(self.execute_async(sched_out, sampling_rows, prompt_logprobs))

    # ---- health and the end ------------------------------------------------------------------
    def check_health(self) -> None:
        """Raise ``WorkerFailedError`` when a worker died or failed (a no-op in-process)."""
        return None

    def set_failure_callback(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` once when a worker fails (from the thread that noticed); an
        in-process model has no workers to fail."""
        return None

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every rank's worker; their results in rank order."""
        raise NotImplementedError(f"{type(self).__name__} has no workers to call")

    def shutdown(self) -> None:
        """Stop the workers and release what they hold (idempotent)."""
        return None
