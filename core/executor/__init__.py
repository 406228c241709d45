"""Executors: how the workers of one model replica run (in-process, processes, Ray actors).

See ``engine.executor.base`` for the interface, ``uniproc``, ``multiproc`` and
``ray_executor`` for the three backends, ``worker`` for what runs in each worker process.
"""

from engine.executor.backends import executor_class
from engine.executor.base import Executor, WorkerFailedError

__all__ = ["Executor", "WorkerFailedError", "executor_class"]
