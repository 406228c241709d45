"""Shared by the server tests: ``RunningServer`` (an ``ApiServer`` on 127.0.0.1 and a free
port, in a background thread) and the engine configuration they serve."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx

from engine.server.app import Phase, ServerOptions
from engine.server.launcher import ApiServer, LaunchOptions

API_KEY = "test-key-123"
MAX_MODEL_LEN = 256


class RunningServer:
    """An ``ApiServer`` running in a background thread (``with`` starts and stops it)."""

    def __init__(
        self,
        engine_factory,
        options: ServerOptions | None = None,
        launch: LaunchOptions | None = None,
    ) -> None:
        # The server stays up after an engine failure, so tests can look at its answers then
        # (engine serve exits instead: tests/server/test_engine_core_process.py).
        launch = launch or LaunchOptions(
            port=0, log_stats_interval=0.0, access_log=False, exit_on_engine_death=False
        )
        self.server = ApiServer(engine_factory, options or ServerOptions(), launch)
        self.thread = threading.Thread(target=self.server.run, name="test-server", daemon=True)
        self.base_url = f"http://127.0.0.1:{self.server.port}"

    @property
    def engine(self):
        """The ``EngineCore`` being served (in a thread of this process), once it handled
        every message sent to it so far: aborts and stop-string stops free KV blocks in the
        core's thread, after the response went out."""
        client = self.server.state.engine.client
        thread = getattr(client, "_thread", None)
        if thread is not None and thread.is_alive():
            assert client._loop_runner.sync(), "the engine core thread did not answer"
        return client.core

    def __enter__(self) -> RunningServer:
        self.thread.start()
        assert self.server.ready.wait(120), "the server did not become ready"
        assert self.server.state.phase is Phase.READY, self.server.state.startup_error
        return self

    def __exit__(self, *exc) -> None:
        self.server.request_shutdown()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the server did not stop"


def engine_config(model_dir: Path, **overrides):
    """The ``EngineConfig`` the tests serve (float32 on CPU, a small KV cache)."""
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    cache = CacheConfig(block_size=16, cpu_kv_cache_gb=0.05)
    return EngineConfig(
        model=ModelConfig(
            model=str(model_dir),
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            served_model_name=overrides.pop("served_model_name", "tiny"),
        ),
        cache=cache,
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
        platform="cpu",
        **overrides,
    )


# ------------------------------------------------------------------ engine serve, for real
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_flags(model_dir: Path) -> list[str]:
    """``engine serve`` flags for the configuration ``engine_config`` builds."""
    return [
        str(model_dir),
        "--platform", "cpu",
        "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--block-size", "16",
        "--cpu-kv-cache-gb", "0.05",
        "--max-num-seqs", "64",
        "--max-num-batched-tokens", "2048",
        "--served-model-name", "tiny",
    ]  # fmt: skip


class ServeProcess:
    """``engine serve`` in a subprocess (the command line's path: engine-core processes, and
    front-end processes with ``--api-server-count``), on a free port."""

    def __init__(self, model_dir: Path, log_path: Path, *flags: str) -> None:
        import os
        import subprocess
        import sys

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w+")
        cmd = [
            sys.executable,
            "-c",
            "from engine.cli.main import main; raise SystemExit(main())",
            "serve",
            *serve_flags(model_dir),
            "--port",
            str(self.port),
            "--disable-uvicorn-access-log",
            *flags,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 180.0) -> ServeProcess:
        import time

        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"engine serve exited:\n{self.log()}"
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"engine serve did not become ready:\n{self.log()}")

    def descendants(self) -> list:
        """Every process started under the server (psutil.Process objects)."""
        import psutil

        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (a drain), then wait; kill if it does not exit."""
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"engine serve did not stop:\n{self.log()}") from None

    def __enter__(self) -> ServeProcess:
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        children = self.descendants()
        if self.proc.poll() is None:
            self.stop()
        for child in children:  # nothing may outlive the server
            try:
                child.wait(10)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._log.close()


def metric_values(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one metric in a Prometheus text exposition."""
    values = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            values[key[len(name) :]] = float(value)
    return values


ENVELOPE_KEYS = {"message", "type", "param", "code"}


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ENVELOPE_KEYS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def keep_alive_after(server, bad_body: str, expect_status: int) -> dict:
    """Send ``bad_body`` then a valid request on one connection; both must be answered."""
    from raw_http import RawConnection

    host, port = server.base_url.removeprefix("http://").split(":")
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with RawConnection(host, int(port)) as conn:
        first = conn.post("/v1/completions", bad_body, auth)
        assert first.status == expect_status, first.body
        assert first.headers.get("connection", "").lower() != "close"
        err = first.json()["error"]
        assert set(err) == ENVELOPE_KEYS
        good = {"prompt": "Hello world", "max_tokens": 2, "temperature": 0}
        second = conn.post("/v1/completions", json.dumps(good), auth)
        assert second.status == 200, second.body
        assert second.json()["usage"]["completion_tokens"] == 2
        return err
