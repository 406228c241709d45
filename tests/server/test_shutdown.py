"""Graceful shutdown: SIGTERM drains in-flight requests, refuses new ones with 503, exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
from fake_engine import FakeEngine
from server_harness import RunningServer

from engine.server.launcher import LaunchOptions

# The drain test's context: its in-flight stream must outlast the SIGTERM and the first 503 the
# test waits for, even on a loaded machine (the shared fixture's 256 tokens did not, once).
DRAIN_MODEL_LEN = 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited during startup"
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server did not become ready")


def test_sigterm_drains_in_flight_requests(tmp_path):
    from engine.testing.tiny_models import build_tiny_model

    tiny_model_dir = build_tiny_model(
        tmp_path / "m", "llama", max_position_embeddings=DRAIN_MODEL_LEN
    )
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w+")
    cmd = [
        sys.executable,
        "-c",
        "from engine.cli.main import main; raise SystemExit(main())",
        "serve",
        str(tiny_model_dir),
        "--port",
        str(port),
        "--platform",
        "cpu",
        "--dtype",
        "float32",
        "--max-model-len",
        str(DRAIN_MODEL_LEN),
        "--cpu-kv-cache-gb",
        "0.05",
        "--served-model-name",
        "tiny",
        "--shutdown-timeout",
        "60",
        "--disable-access-log-for-endpoints",
        "/health,/metrics",
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        wait_ready(base, proc)
        started = threading.Event()
        lines: list[str] = []

        def stream() -> None:
            body = {
                "prompt": "drain me",
                "max_tokens": DRAIN_MODEL_LEN - 16,
                "ignore_eos": True,
                "stream": True,
                "temperature": 0,
            }
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        proc.send_signal(signal.SIGTERM)
        # Draining: health and new requests answer 503 while the stream goes on.
        deadline = time.monotonic() + 10
        while httpx.get(base + "/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        refused = httpx.post(base + "/v1/completions", json={"prompt": "late", "max_tokens": 1})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        t.join(120)
        assert not t.is_alive()
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    text = log.read()
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    # On failure, the last chunk (an error's envelope, say) and the server's log say why.
    why = f"last chunk {chunks[-1]}; {len(chunks)} chunks; server log:\n{text[-3000:]}"
    assert "choices" in chunks[-1], why
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", why
    assert "draining" not in lines[-2]
    assert "shutting down: waiting up to 60 s for 1 in-flight request(s)" in text
    assert "ready in" in text
    assert '"GET /health' not in text  # silenced access-log lines


def test_shutdown_timeout_aborts_what_is_left(tmp_path):
    from engine.testing.tiny_models import build_tokenizer

    fake = FakeEngine(build_tokenizer(tmp_path), step_delay=0.02)
    launch = LaunchOptions(port=0, shutdown_timeout=0.3, log_stats_interval=0, access_log=False)
    srv = RunningServer(lambda: fake, launch=launch).__enter__()
    results: dict[str, object] = {}
    lines: list[str] = []

    def plain() -> None:
        results["plain"] = httpx.post(
            srv.base_url + "/v1/completions", json={"prompt": "a", "max_tokens": 120}, timeout=30
        )

    def streamed() -> None:
        body = {"prompt": "b", "max_tokens": 120, "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=30) as r:
            lines.extend(line for line in r.iter_lines() if line)

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(fake.requests) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    srv.server.request_shutdown()
    for t in threads:
        t.join(30)
    srv.thread.join(30)
    assert not srv.thread.is_alive()
    r = results["plain"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
    assert lines[-1] == "data: [DONE]" and "server_shutting_down" in lines[-2]
    assert not fake.requests  # aborted in the engine too
