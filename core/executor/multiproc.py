"""``MultiprocExecutor`` (``--distributed-executor-backend mp``): one process per rank, this host.

Each worker is a fresh interpreter (``python -m engine.executor``: no forked CUDA context, no
inherited threads, and, unlike multiprocessing's ``spawn``, no re-import of the user's main
script, so a script without an ``if __name__ == "__main__"`` guard works), started from a
dedicated monitor thread that then waits on the workers' exits (a pidfd per process where the
kernel has them): a worker that exits for any reason (an exception, ``kill -9``, the OOM
killer) is noticed at once, the executor becomes failed, the other workers are killed and the
engine's waiting call raises ``WorkerFailedError``.

No worker outlives the engine: each sets ``PR_SET_PDEATHSIG`` (Linux), so the kernel kills it
when the thread that started it goes away, which is the monitor thread, alive until
``shutdown`` (or the engine process's death); each runs in its own process group, so a Ctrl-C
in the terminal reaches only the engine (which shuts the workers down in order) and shutdown
can kill a worker together with anything it started.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

from engine.executor.remote import RemoteExecutor
from engine.parent_death import die_with_parent

if TYPE_CHECKING:
    from engine.executor.worker import WorkerSpec

logger = logging.getLogger(__name__)


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def worker_process_main(parent_pid: int) -> None:
    """Entry point of a worker process (``python -m engine.executor worker PARENT_PID``): the
    pickled ``WorkerSpec`` arrives on stdin."""
    die_with_parent(parent_pid)
    try:
        os.setpgid(0, 0)  # our own process group (see the module docstring)
    except OSError:
        pass
    spec = pickle.load(sys.stdin.buffer)
    sys.stdin.close()
    from engine.executor.worker import run_worker

    code = 0
    try:
        run_worker(spec)
    except BaseException:  # noqa: BLE001 - already reported to the engine; exit non-zero
        code = 1
    # Everything that matters is closed; skip the interpreter's slow teardown of torch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


class _ExitWatch:
    """A file descriptor that becomes readable when a process exits: its pidfd, or the read
    end of a pipe whose write end only the process holds."""

    def __init__(self, process: subprocess.Popen, pipe_r: int | None) -> None:
        self.process = process
        self._pipe_r = pipe_r
        self.fd = pipe_r
        if hasattr(os, "pidfd_open"):
            try:
                self.fd = os.pidfd_open(process.pid)
            except OSError:
                pass

    def close(self) -> None:
        for fd in {self.fd, self._pipe_r}:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


class MultiprocExecutor(RemoteExecutor):
    """One spawned worker process per rank on this host (see the module docstring)."""

    name = "mp"

    def _prepare_workers(self) -> tuple[str, list[tuple[int, int]]]:
        n = self.world_size
        return f"tcp://127.0.0.1:{_free_port()}", [(rank, n) for rank in range(n)]

    def _start_workers(self, specs: list[WorkerSpec]) -> None:
        self._processes: list[subprocess.Popen] = []
        self._watches: list[_ExitWatch] = []
        self._stop_r, self._stop_w = os.pipe()
        self._spawned = threading.Event()
        self._spawn_error: BaseException | None = None
        self._monitor = threading.Thread(
            target=self._spawn_and_watch, args=(specs,), name="engine-workers", daemon=True
        )
        self._monitor.start()
        self._spawned.wait()
        if self._spawn_error is not None:
            raise self._spawn_error

    def _spawn(self, spec: WorkerSpec) -> None:
        pipe_r, pipe_w = os.pipe()
        flags = ["-P"] if sys.version_info >= (3, 11) else []  # no cwd on sys.path
        command = [sys.executable, *flags, "-m", "engine.executor", "worker", str(os.getpid())]
        process = subprocess.Popen(command, stdin=subprocess.PIPE, pass_fds=(pipe_w,))
        os.close(pipe_w)
        self._processes.append(process)
        self._watches.append(_ExitWatch(process, pipe_r))
        assert process.stdin is not None
        process.stdin.write(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
        process.stdin.close()

    def _spawn_and_watch(self, specs: list[WorkerSpec]) -> None:
        """The monitor thread: start the workers, then wait for any of them to exit."""
        try:
            for spec in specs:
                self._spawn(spec)
        except BaseException as e:  # noqa: BLE001 - re-raised by _start_workers
            self._spawn_error = e
        finally:
            self._spawned.set()
        if self._spawn_error is not None:
            self._kill_all()
            return
        logger.info(
            "started %d worker processes: %s",
            len(self._processes),
            ", ".join(str(p.pid) for p in self._processes),
        )
        by_fd = {w.fd: (rank, w.process) for rank, w in enumerate(self._watches)}
        while by_fd:
            ready = multiprocessing.connection.wait([*by_fd, self._stop_r])
            if self._stop_r in ready:
                break
            for fd in ready:
                rank, process = by_fd.pop(fd)
                returncode = process.wait()
                self._worker_died(
                    f"worker rank {rank} (pid {process.pid}) {describe_exit(returncode)}"
                )
            if self._failure is not None:
                self._kill_all()  # the replica is broken: no rank must hang in a collective
                for process in self._processes:
                    _wait(process, 5.0)  # reap them: no zombie is left either
                break
        # PR_SET_PDEATHSIG is tied to this thread: it stays until shutdown has stopped the
        # workers (shutdown writes to the stop pipe after joining them).
        multiprocessing.connection.wait([self._stop_r])

    def _kill_all(self, sig: int = signal.SIGKILL) -> None:
        for process in self._processes:
            if process.poll() is None:
                _kill_group(process.pid, sig)

    def _stop_workers(self, timeout_s: float) -> None:
        processes = getattr(self, "_processes", [])
        deadline = time.monotonic() + timeout_s
        for process in processes:
            _wait(process, deadline - time.monotonic())
        for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
            alive = [p for p in processes if p.poll() is None]
            if not alive:
                break
            logger.warning(
                "%d worker(s) still running after shutdown; sending %s",
                len(alive),
                signal.Signals(sig).name,
            )
            for process in alive:
                _kill_group(process.pid, sig)
            for process in alive:
                _wait(process, wait)
        if hasattr(self, "_stop_w"):
            try:
                os.write(self._stop_w, b"x")
            except OSError:
                pass
            self._monitor.join(timeout=5)
            for fd in (self._stop_r, self._stop_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
            for watch in self._watches:
                watch.close()


def _wait(process: subprocess.Popen, timeout_s: float) -> None:
    try:
        process.wait(max(0.0, timeout_s))
    except subprocess.TimeoutExpired:
        pass


def _kill_group(pid: int, sig: int) -> None:
    """Signal a worker's process group (the worker and anything it started)."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
