"""Shared by the server tests: ``RunningServer`` (an ``ApiServer`` on 127.0.0.1 and a free
port, in a background thread) and the engine configuration they serve."""

from __future__ import annotations

import threading
from pathlib import Path

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
