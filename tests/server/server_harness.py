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
        launch = launch or LaunchOptions(port=0, log_stats_interval=0.0, access_log=False)
        self.server = ApiServer(engine_factory, options or ServerOptions(), launch)
        self.thread = threading.Thread(target=self.server.run, name="test-server", daemon=True)
        self.base_url = f"http://127.0.0.1:{self.server.port}"

    @property
    def engine(self):
        """The ``LLMEngine`` being served."""
        return self.server.state.engine.engine

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
