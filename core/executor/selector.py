"""The executor class for a ``--distributed-executor-backend`` name.

Kept apart from ``engine.executor.base``: the backends import the base class, so the base
module cannot also import the backends without a cycle.
"""

from __future__ import annotations

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
