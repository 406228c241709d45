"""``UniProcExecutor``: the replica is one ``ModelRunner`` in the engine's own process."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.executor.base import Executor

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner


class UniProcExecutor(Executor):
    """World size 1: steps go straight to the runner (its ``execute_async`` and ``collect``
    are this executor's, bound once, so a step costs what it cost before executors existed).

    Attributes the executor does not define are the runner's (``model``, ``kv_caches``,
    ``num_blocks``, ``graphs``...), so code that inspects ``engine.runner`` keeps working;
    so are writes to them (``engine.runner.proposer = ...`` installs a proposer on the
    runner rather than a dead attribute on the executor).
    """

    name = "uni"
    # What the executor itself holds; every other attribute is the runner's, read or written.
    _OWN = frozenset(
        {"runner", "config", "attn_backend_cls", "execute_async", "collect", "execute"}
    )

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.config = runner.config
        self.attn_backend_cls = runner.attn_backend_cls
        self.execute_async = runner.execute_async  # type: ignore[method-assign]
        self.collect = runner.collect  # type: ignore[method-assign]
        self.execute = runner.execute  # type: ignore[method-assign]

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.runner, name, value)

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found on the executor itself.
        if name == "runner":
            raise AttributeError(name)
        return getattr(self.runner, name)

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def device(self) -> Any:
        return self.runner.device

    @property
    def num_blocks(self) -> int:  # type: ignore[override]
        return self.runner.num_blocks

    @property
    def graphs(self) -> Any:  # type: ignore[override]
        return self.runner.graphs

    @property
    def max_concurrent_batches(self) -> int:
        return 1

    def kv_cache_groups(self) -> list[int | None]:
        return self.runner.kv_cache_groups()

    def determine_num_blocks(self, max_model_len_fixed: bool = True) -> int:
        return self.runner.determine_num_blocks(max_model_len_fixed=max_model_len_fixed)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def capture_graphs(self, eager: bool = False) -> float | None:
        """The runner's ``capture_graphs`` (``eager=True``: its replay machinery without
        recorded graphs, which tests drive on the CPU)."""
        return self.runner.capture_graphs(eager=eager)

    def execute_async(self, sched_out, sampling_rows, prompt_logprobs=None):  # noqa: D102
        return self.runner.execute_async(sched_out, sampling_rows, prompt_logprobs)

    def collect(self, pending):  # noqa: D102
        return self.runner.collect(pending)

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.runner, method)(*args, **kwargs)]
