"""``die_with_parent``: the one helper engine-core processes and executor workers start with."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = """
import ctypes, os, sys
from engine.parent_death import die_with_parent
die_with_parent(int(sys.argv[1]))
if sys.platform.startswith("linux"):
    sig = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
    print(sig.value)
else:
    print("alive")
"""


def _child(parent_pid: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(parent_pid)], capture_output=True, text=True, timeout=60
    )


def test_a_child_of_a_live_parent_runs_on_with_the_signal_armed():
    run = _child(os.getpid())
    assert run.returncode == 0, run.stderr
    expected = "9" if sys.platform.startswith("linux") else "alive"  # SIGKILL
    assert run.stdout.strip() == expected


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX parent pids")
def test_a_child_whose_parent_is_already_gone_exits_at_once():
    # Not our pid: as if the parent had died and the child been re-parented before it armed.
    run = _child(os.getpid() + 1_000_000)
    assert run.returncode == 1 and run.stdout == ""
