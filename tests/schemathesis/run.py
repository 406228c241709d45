"""Fuzz the OpenAI-compatible server with schemathesis, every check on, in one command.

    python tests/schemathesis/run.py [--server generate|pooling|both] [schemathesis options...]

runs schemathesis against two live servers, one after the other (``--server`` picks one):

- ``generate``: a tiny random Llama (``engine.testing.tiny_models``) served by ``engine serve``
  on a free local port; every operation in its document (the embedding routes are left out
  of a generative model's);
- ``pooling``: a tiny random Qwen3 embedding model (``engine.testing.tiny_embedding_models``,
  last-token pooling, normalized, matryoshka dimensions 8/16/32) served with ``--runner
  pooling``; ``/v1/embeddings``, ``/score`` and ``/rerank`` only (the other routes are the
  same code on either model, and the generation routes answer a pooling model with a 400).

Each run is

    schemathesis run http://127.0.0.1:PORT/openapi.json --checks all --max-examples 150 ...

with the hooks of ``hooks.py`` (constraints between fields that a JSON schema cannot state).
The script prints schemathesis' reports, stops each server and exits non-zero if either run
failed or a server logged an ERROR line. Options given to this script are appended to
schemathesis' (a later one wins, e.g. ``--seed 7`` or ``--max-examples 300``).
``tox -e schemathesis`` runs it with schemathesis pinned.
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


POOLING_SERVE_ARGS = [
    "--runner",
    "pooling",
    "--dtype",
    "float32",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--cpu-kv-cache-gb",
    "0.1",
    "--max-num-seqs",
    "16",
    "--disable-uvicorn-access-log",
    "--disable-log-stats",
]


def fuzz(model: Path, serve_args: list[str], workdir: Path, extra: list[str]) -> int:
    """Serve ``model`` with ``serve_args``, run schemathesis against it with ``extra``, and
    return its status (1 as well when the server logged an ERROR line)."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    log = open(workdir / "serve.log", "w")  # noqa: SIM115 - closed in finally
    server = subprocess.Popen(
        ["engine", "serve", str(model), "--port", str(port), *serve_args],
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
    print(f"\nserver log: {workdir / 'serve.log'}", flush=True)
    return status


def main(argv: list[str]) -> int:
    from engine.testing.tiny_embedding_models import save_st_model
    from engine.testing.tiny_models import build_tiny_model

    if shutil.which("schemathesis") is None:
        raise SystemExit("schemathesis is not installed: pip install schemathesis==4.32.5")
    servers = ("generate", "pooling")
    extra = list(argv)
    if "--server" in extra:
        i = extra.index("--server")
        choice = extra[i + 1] if i + 1 < len(extra) else ""
        if choice not in (*servers, "both"):
            raise SystemExit("--server takes generate, pooling or both")
        servers = servers if choice == "both" else (choice,)
        del extra[i : i + 2]
    workdir = Path(tempfile.mkdtemp(prefix="engine-schemathesis-"))
    statuses = {}
    if "generate" in servers:
        model = build_tiny_model(workdir / "model", "llama", max_position_embeddings=MAX_MODEL_LEN)
        # The embedding routes are not in a generative model's document (the pooling run
        # covers them).
        args = [*extra]
        statuses["generate"] = fuzz(model, SERVE_ARGS, workdir / "generate", args)
    if "pooling" in servers:
        model = save_st_model(
            workdir / "embed",
            "qwen3",
            "lasttoken",
            normalize=True,
            config_extra={"matryoshka_dimensions": [8, 16, 32]},
            max_position_embeddings=MAX_MODEL_LEN,
        )
        args = ["--include-path-regex", "^/(v1/embeddings|(v1/)?score|(v[12]/)?rerank)$", *extra]
        statuses["pooling"] = fuzz(model, POOLING_SERVE_ARGS, workdir / "pooling", args)
    print("\n" + ", ".join(f"{name}: exit status {s}" for name, s in statuses.items()))
    return max(statuses.values())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
