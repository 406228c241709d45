"""ZMQ sockets and addresses between front ends and engine cores.

Addresses are ``ipc://`` endpoints: in Linux's abstract socket namespace (``ipc://@name``),
which leaves nothing on disk to clean up, however the processes end; elsewhere, socket files
in a private temporary directory that ``Endpoints.close()`` removes. Sockets never block a
sender (no high-water mark: outputs are small and the reader catches up) and drop unsent
messages on close unless a linger is given.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from typing import Any


class Endpoints:
    """The addresses of one server's (or one ``LLM``'s) engine cores and front ends."""

    def __init__(self) -> None:
        self._session = f"engine-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._dir: str | None = None
        if not sys.platform.startswith("linux"):
            self._dir = tempfile.mkdtemp(prefix="engine-ipc-")

    def _address(self, name: str) -> str:
        if self._dir is None:
            return f"ipc://@{self._session}-{name}"
        return f"ipc://{os.path.join(self._dir, name)}"

    def core_input(self, engine_index: int) -> str:
        """Where engine core ``engine_index`` receives requests (it binds)."""
        return self._address(f"core-{engine_index}")

    def client_output(self, client_index: int) -> str:
        """Where front end ``client_index`` receives outputs (it binds)."""
        return self._address(f"client-{client_index}")

    def close(self) -> None:
        """Remove the socket directory, if there is one (idempotent)."""
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def make_socket(ctx: Any, kind: int, address: str, *, bind: bool) -> Any:
    """A ZMQ socket of ``kind`` bound or connected to ``address``."""
    import zmq

    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock
