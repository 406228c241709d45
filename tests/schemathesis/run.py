"""Fuzz the OpenAI-compatible server with schemathesis, every check on, in one command.

    python tests/schemathesis/run.py [schemathesis options...]

builds a tiny random Llama (``engine.testing.tiny_models``) in a temporary directory, starts
``engine serve`` on it on a free local port, waits for ``/health``, runs

    schemathesis run http://127.0.0.1:PORT/openapi.json --checks all --max-examples 150 ...

with the hooks of ``hooks.py`` (constraints between fields that a JSON schema cannot state),
prints schemathesis' report, stops the server and exits with schemathesis' status. Options
given to this script are appended to schemathesis' (a later one wins, e.g. ``--seed 7`` or
``--max-examples 300``). ``tox -e schemathesis`` runs it with schemathesis pinned.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAX_MODEL_LEN = 512
# What the run checks the server with: every check, a fixed seed, enough cases per operation
# for more than 1,000 in all, one worker (the 2-core CI machines run the model too).
SCHEMATHESIS_ARGS = [
    "--checks",
    "all",
    "--max-examples",
    "150",
    "--seed",
    "20260401",
    "--workers",
    "1",
    "--request-timeout",
    "120",
    "--suppress-health-check",
    "too_slow,filter_too_much",
]
SERVE_ARGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--cpu-kv-cache-gb",
    "0.1",
    "--max-num-seqs",
    "16",
    "--max-n",
    "4",
    "--enable-tokenizer-info-endpoint",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--disable-uvicorn-access-log",
    "--disable-log-stats",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"engine serve exited with status {server.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise SystemExit(f"engine serve was not healthy after {timeout:.0f} s")


def main(extra: list[str]) -> int:
    from engine.testing.tiny_models import build_tiny_model

    if shutil.which("schemathesis") is None:
        raise SystemExit("schemathesis is not installed: pip install schemathesis==4.32.5")
    workdir = Path(tempfile.mkdtemp(prefix="engine-schemathesis-"))
    model = build_tiny_model(workdir / "model", "llama", max_position_embeddings=MAX_MODEL_LEN)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    log = open(workdir / "serve.log", "w")  # noqa: SIM115 - closed in finally
    server = subprocess.Popen(
        ["engine", "serve", str(model), "--port", str(port), *SERVE_ARGS],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=workdir,
    )
    try:
        wait_healthy(base, server)
        command = [
            "schemathesis",
            "run",
            f"{base}/openapi.json",
            *SCHEMATHESIS_ARGS,
            "--report-dir",
            str(workdir / "report"),
            *extra,
        ]
        print("$", " ".join(command), flush=True)
        hooks_env = {
            **env,
            "SCHEMATHESIS_HOOKS": "hooks",
            "PYTHONPATH": str(HERE),
            "ENGINE_SCHEMATHESIS_URL": base,
            "ENGINE_SCHEMATHESIS_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        }
        status = subprocess.call(command, env=hooks_env, cwd=workdir)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    errors = [line for line in (workdir / "serve.log").read_text().splitlines() if "ERROR" in line]
    if errors:
        print("\nERROR lines in the server log:", *errors[:20], sep="\n  ")
        status = status or 1
    print(f"\nserver log: {workdir / 'serve.log'}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
