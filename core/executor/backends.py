"""``executor_class``: the executor class of a ``--distributed-executor-backend`` name.

Apart from ``base`` (the interface every backend imports), so that choosing a backend does not
make the interface import its implementations (an import cycle)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.executor.base import Executor


def executor_class(backend: str) -> type[Executor]:
    """The executor class for a ``--distributed-executor-backend`` name."""
    if backend == "uni":
        from engine.executor.uniproc import UniProcExecutor

        return UniProcExecutor
    if backend == "mp":
        from engine.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from engine.executor.ray_executor import RayExecutor

        return RayExecutor
    raise ValueError(f"unknown distributed executor backend {backend!r}; choose uni, mp or ray")
