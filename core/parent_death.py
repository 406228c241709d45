"""``die_with_parent``: a child process that the kernel kills when its parent goes away.

Both kinds of child the engine starts call it first thing: engine-core and API-server
processes (``engine.engine_core.processes``) and executor workers
(``engine.executor.multiproc``). On Linux it arms ``prctl(PR_SET_PDEATHSIG, SIGKILL)``; the
signal follows the *thread* that forked the child, so the parents fork from a long-lived thread.
Elsewhere only the check that the parent is still there holds (and the callers' other ties, a
watched stdin or pipe).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux), and exit at once
    when the parent (``parent_pid``) has already died, before the signal was armed."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
                logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        except OSError as e:  # no libc symbol: the caller's other ties still hold
            logger.warning("prctl(PR_SET_PDEATHSIG) unavailable: %s", e)
    if os.getppid() != parent_pid:
        os._exit(1)
