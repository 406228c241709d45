"""The control channel between the engine and its workers: ZMQ, no pipes, no polling loops.

* **Broadcast** (engine -> every worker): one XPUB socket; each step is one message that every
  worker's SUB socket receives (a scheduled step, an RPC, or shutdown). The engine waits until
  every worker has subscribed before sending anything, so nothing is lost to ZMQ's "slow
  joiner". ipc:// on one host, tcp:// across hosts (Ray).
* **Replies** (workers -> engine): workers PUSH to one PULL socket: a step's results (from the
  rank that reports them), RPC replies, errors. A monitor thread in the engine pushes a
  "worker died" message into the same socket, so a death wakes a waiting engine at once.

Messages are multipart: a one-byte tag, then the payload (msgspec-encoded steps, pickled RPCs
and results: both small).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import uuid
from typing import Any

import zmq

# engine -> workers
STEP = b"S"
RPC = b"R"
SHUTDOWN = b"X"
# workers -> engine
OUTPUT = b"O"
REPLY = b"P"
ERROR = b"E"

# ZMQ's subscription message for "everything" on an XPUB socket.
_SUBSCRIBE_ALL = b"\x01"


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes | memoryview) -> Any:
    return pickle.loads(data)


class DriverChannels:
    """The engine's ends: ``broadcast`` to every worker, ``receive`` what they send back.

    ``host`` None: ipc:// sockets in the temporary directory (workers on this host); else
    tcp:// sockets bound on that address with free ports (workers anywhere that reaches it).
    """

    def __init__(self, host: str | None = None) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.setsockopt(zmq.SNDHWM, 0)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._ipc_paths: list[str] = []
        if host is None:
            base = os.path.join(
                tempfile.gettempdir(), f"engine-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            )
            self.step_address = f"ipc://{base}-steps"
            self.reply_address = f"ipc://{base}-replies"
            self._ipc_paths = [f"{base}-steps", f"{base}-replies"]
            self._pub.bind(self.step_address)
            self._pull.bind(self.reply_address)
        else:
            port = self._pub.bind_to_random_port(f"tcp://{host}")
            self.step_address = f"tcp://{host}:{port}"
            port = self._pull.bind_to_random_port(f"tcp://{host}")
            self.reply_address = f"tcp://{host}:{port}"
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._subscribers = 0

    def wait_for_subscribers(
        self, count: int, timeout_s: float, check: Any = None, what: str = "workers"
    ) -> None:
        """Block until ``count`` workers subscribed to the broadcast; ``check()`` runs every
        so often and raises when a worker is known to have failed."""
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while self._subscribers < count:
            if check is not None:
                check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"only {self._subscribers} of {count} {what} connected within {timeout_s:.0f} s"
                )
            events = dict(poller.poll(min(left, 0.2) * 1000))
            if self._pub in events:
                if self._pub.recv() == _SUBSCRIBE_ALL:
                    self._subscribers += 1
            if self._pull in events:
                # An early failure report (a worker that crashed while starting).
                kind, payload = self._pull.recv_multipart()
                if kind == ERROR:
                    self.early_error = loads(payload)
                    if check is not None:
                        check()

    early_error: Any = None

    @property
    def context(self) -> zmq.Context:
        """The ZMQ context (thread-safe: another thread makes its own sockets from it)."""
        return self._ctx

    def broadcast(self, tag: bytes, payload: bytes = b"") -> None:
        self._pub.send_multipart((tag, payload), copy=False)

    def receive(self, timeout_s: float | None) -> tuple[bytes, bytes] | None:
        """The next ``(kind, payload)`` from a worker (or the monitor), or None on timeout."""
        events = self._poller.poll(None if timeout_s is None else timeout_s * 1000)
        if not events:
            return None
        kind, payload = self._pull.recv_multipart()
        return kind, payload

    def close(self) -> None:
        for sock in (self._pub, self._pull):
            sock.close(linger=0)
        self._ctx.term()
        for path in self._ipc_paths:
            try:
                os.unlink(path)
            except OSError:
                pass


class ReplySender:
    """A PUSH socket to the engine's reply address (one per thread: ZMQ sockets are not
    thread-safe)."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 2000)  # let a last error report reach the engine
        self._sock.connect(address)

    def send(self, kind: bytes, payload: bytes) -> None:
        self._sock.send_multipart((kind, payload), copy=False)

    def close(self) -> None:
        self._sock.close()


class WorkerChannels:
    """A worker's ends: the broadcast it receives and a ``ReplySender``."""

    def __init__(self, step_address: str, reply_address: str) -> None:
        self.ctx = zmq.Context()
        self._sub = self.ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(step_address)
        self.reply_address = reply_address
        self.replies = ReplySender(self.ctx, reply_address)

    def receive(self) -> tuple[bytes, memoryview | bytes]:
        tag, payload = self._sub.recv_multipart(copy=False)
        return tag.bytes, payload.buffer

    def close(self) -> None:
        self._sub.close(linger=0)
        self.replies.close()
        self.ctx.term()
