"""``python -m engine.executor worker PARENT_PID``: a worker process of the ``mp`` executor
(started by ``engine.executor.multiproc``; its ``WorkerSpec`` arrives pickled on stdin)."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] != "worker":
        sys.exit("usage: python -m engine.executor worker PARENT_PID (started by the engine)")
    from engine.executor.multiproc import worker_process_main

    worker_process_main(int(argv[1]))


if __name__ == "__main__":
    main(sys.argv[1:])
