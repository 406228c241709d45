"""Child processes that never outlive their parent, and watching processes die.

``spawn`` starts ``python -c <bootstrap>`` with a fresh interpreter (nothing is forked: no
inherited threads, locks or device state), in a session of its own (a Ctrl-C or a signal to the
server's process group reaches only the parent, which shuts its children down in order), with
the parent's ``sys.path`` and the function to run sent pickled over the child's stdin. Three
things tie a child's life to its parent:

- on Linux, ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills the child when the parent
  dies, even by ``kill -9``. The signal follows the *thread* that forked the child, so every
  child is forked by one long-lived spawner thread, never by a short-lived worker;
- the child's stdin stays open: end of file means the parent died (on every OS) or closed it
  to ask for a shutdown; the child then runs its shutdown handler and exits within
  ``_GRACE_S`` seconds whatever happens;
- a child that starts after its parent already died exits at once (the parent pid is checked).

``watch_process`` calls back when a process (a child or not) exits: a pidfd on Linux (no
polling, no delay), else a 100 ms poll.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import logging
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from engine.parent_death import die_with_parent

logger = logging.getLogger(__name__)

# How long a child may take to exit once its parent is gone or asked it to stop.
_GRACE_S = 10.0

_BOOTSTRAP = (
    "import pickle, sys; payload = pickle.load(sys.stdin.buffer); sys.path[:] = payload['path']; "
    "from engine.engine_core.processes import child_main; child_main(payload)"
)


class ChildProcess:
    """A child started by ``spawn``: ``stop()`` asks it to exit (closing its stdin), then
    terminates and kills it if it does not."""

    def __init__(self, popen: subprocess.Popen, name: str) -> None:
        self.popen = popen
        self.name = name
        self.pid = popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def request_stop(self) -> None:
        """Ask the child to shut down (its stdin closes); returns at once."""
        stdin = self.popen.stdin
        if stdin is not None and not stdin.closed:
            try:
                stdin.close()
            except OSError:
                pass

    def stop(self, timeout: float = _GRACE_S) -> int | None:
        """Ask, wait up to ``timeout`` s, then SIGTERM, then SIGKILL; return the exit status."""
        self.request_stop()
        for sig, wait in ((None, timeout), (signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
            if sig is not None and self.popen.poll() is None:
                try:
                    self.popen.send_signal(sig)
                except ProcessLookupError:
                    pass
            try:
                return self.popen.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        return self.popen.poll()

    def describe_exit(self) -> str:
        code = self.popen.poll()
        if code is None:
            return "is running"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with status {code}"


class _Spawner:
    """One daemon thread that forks every child (see the module docstring: the parent-death
    signal follows the forking thread, and this one lives as long as the process)."""

    _instance: _Spawner | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="engine-spawner", daemon=True).start()

    @classmethod
    def get(cls) -> _Spawner:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def popen(self, args: list[str], kwargs: dict[str, Any]) -> subprocess.Popen:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, args, kwargs))
        return future.result()

    def _run(self) -> None:
        while True:
            future, args, kwargs = self._jobs.get()
            try:
                future.set_result(subprocess.Popen(args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)


def spawn(
    name: str,
    target: str,
    args: Sequence[Any] = (),
    *,
    env: dict[str, str] | None = None,
    pass_fds: Sequence[int] = (),
) -> ChildProcess:
    """Start ``target`` (``"module:function"``) with ``args`` (pickled) in a child process.

    ``env`` entries are added to (``None`` values removed from) this process's environment.
    The function's return value is the child's exit status.
    """
    child_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            child_env.pop(key, None)
        else:
            child_env[key] = value
    popen = _Spawner.get().popen(
        [sys.executable, "-c", _BOOTSTRAP, name],  # the name shows in ps
        {
            "stdin": subprocess.PIPE,
            "env": child_env,
            "start_new_session": True,
            "pass_fds": tuple(pass_fds),
        },
    )
    payload = {
        "path": list(sys.path),
        "name": name,
        "target": target,
        "args": tuple(args),
        "parent_pid": os.getpid(),
    }
    try:
        popen.stdin.write(pickle.dumps(payload))
        popen.stdin.flush()
    except BaseException:
        popen.kill()
        popen.wait()
        raise
    return ChildProcess(popen, name)


# ------------------------------------------------------------------------- in the child
_shutdown_handler: Callable[[], None] | None = None
_grace_s = _GRACE_S


def set_shutdown_handler(handler: Callable[[], None], grace_s: float = _GRACE_S) -> None:
    """What a child does when its parent is gone or asks it to stop (stdin closed) or on
    SIGTERM: typically, ask its main loop to finish. The child exits ``grace_s`` seconds later
    if it has not exited by then."""
    global _shutdown_handler, _grace_s
    _shutdown_handler = handler
    _grace_s = grace_s


_stopping = threading.Event()


def _begin_shutdown(reason: str) -> None:
    if _stopping.is_set():
        return
    _stopping.set()

    def deadline() -> None:
        time.sleep(_grace_s)
        os._exit(1)

    threading.Thread(target=deadline, name="shutdown-deadline", daemon=True).start()
    handler = _shutdown_handler
    if handler is None:
        os._exit(0 if reason == "stop" else 1)
    handler()


def _watch_stdin() -> None:
    """Block until the parent closes our stdin or dies, then shut down."""
    try:
        while sys.stdin.buffer.read(65536):
            pass
    except (OSError, ValueError):
        pass
    _begin_shutdown("stop")


def child_main(payload: dict[str, Any]) -> None:
    """The child's entry point (called by the bootstrap)."""
    die_with_parent(payload["parent_pid"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    signal.signal(signal.SIGTERM, lambda *_: _begin_shutdown("sigterm"))
    threading.Thread(target=_watch_stdin, name="parent-watch", daemon=True).start()
    module, _, function = payload["target"].partition(":")
    fn = getattr(importlib.import_module(module), function)
    code = fn(*payload["args"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))


# ------------------------------------------------------------------------- watching
def watch_process(
    loop: asyncio.AbstractEventLoop,
    pid: int,
    on_exit: Callable[[], None],
    popen: subprocess.Popen | None = None,
) -> Callable[[], None]:
    """Call ``on_exit`` in ``loop`` once process ``pid`` has exited; returns a function that
    cancels the watch. ``popen``: the ``Popen`` when it is our child (its status is read)."""
    fired = False

    def fire() -> None:
        nonlocal fired
        if not fired:
            fired = True
            cancel()
            on_exit()

    if hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            loop.call_soon(on_exit)
            return lambda: None
        except OSError:
            fd = None
        if fd is not None:

            def cancel() -> None:
                try:
                    loop.remove_reader(fd)
                except (ValueError, RuntimeError):  # the loop closed meanwhile
                    pass
                try:
                    os.close(fd)
                except OSError:
                    pass

            loop.add_reader(fd, fire)
            return cancel

    handle: asyncio.TimerHandle | None = None

    def poll() -> None:
        nonlocal handle
        if not process_alive(pid, popen):
            fire()
        else:
            handle = loop.call_later(0.1, poll)

    def cancel() -> None:  # noqa: F811 - the polling variant
        if handle is not None:
            handle.cancel()

    handle = loop.call_later(0.1, poll)
    return cancel


def process_alive(pid: int, popen: subprocess.Popen | None = None) -> bool:
    """Whether ``pid`` runs (a zombie counts as exited)."""
    if popen is not None:
        return popen.poll() is None
    try:
        import psutil

        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except Exception:  # noqa: BLE001 - NoSuchProcess, AccessDenied...
        return False
