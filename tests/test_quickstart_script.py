"""examples/quickstart.sh: it tells the user to send requests only once the server answers
/health with 200, names the URL the server really listens on (its --port), and Ctrl-C stops
the server cleanly. ``SKIP_INSTALL=1`` skips the venv and pip steps (the test environment
already has the engine), so the serve-and-wait part runs as the user gets it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "quickstart.sh"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status
    except OSError as e:
        return getattr(e, "code", None)


def test_waits_for_health_and_names_the_real_port(tmp_path):
    from engine.testing.tiny_models import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", "llama", max_position_embeddings=128)
    port = free_port()
    env = {
        **os.environ,
        "SKIP_INSTALL": "1",
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), str(model), "--port", str(port), "--max-num-seqs", "2"],
        cwd=tmp_path,
        env=env,
        # A terminal's Ctrl-C: SIGINT at its default. A test run started in the background
        # (`cmd &` in a script) inherits SIGINT ignored, and bash cannot trap a signal that
        # was ignored on entry, so the script's Ctrl-C handling would never run.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    lines: list[tuple[str, int | None]] = []  # stderr, and /health when a line names curl

    def read() -> None:
        for line in proc.stderr:
            lines.append((line.rstrip("\n"), health(port) if "curl" in line else None))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("ready on" in line for line, _ in lines):
            assert proc.poll() is None, "\n".join(line for line, _ in lines)
            assert time.monotonic() < deadline, "\n".join(line for line, _ in lines)
            time.sleep(0.2)
        text = "\n".join(line for line, _ in lines)
        assert f"starting the server on http://127.0.0.1:{port}" in text
        curl = [(line, status) for line, status in lines if "curl" in line]
        assert curl == [
            (f"engine: ready on http://127.0.0.1:{port}; try: curl "
             f"http://127.0.0.1:{port}/v1/models (Ctrl-C stops the server)", 200)
        ], text  # fmt: skip
        assert "8000" not in text
        assert '"GET /health' not in text  # the script's polling stays out of the log
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends the script
        assert proc.wait(60) == 0, text
        assert health(port) is None  # the server is gone
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_its_virtual_environment_is_ignored_by_git():
    """The script makes .venv-engine/ in the directory it runs from, usually the checkout."""
    import shutil

    root = SCRIPT.parent.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        import pytest

        pytest.skip("not a git checkout")
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", ".venv-engine/bin/python"], cwd=root, check=False
    )
    assert ignored.returncode == 0, ".venv-engine/ is not in .gitignore"
