"""Fixtures for the server tests: a real uvicorn server on 127.0.0.1 and a free port.

The model is a tiny random Llama with a trained BPE tokenizer and a chat template, written to a
temporary directory once per session; the server runs in a thread of the test process so that
tests can look at the engine (``num_used_blocks``) directly.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server_harness import RunningServer

from engine.server.app import ServerOptions

API_KEY = "test-key-123"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from engine.testing.tiny_models import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-llama"), "llama", max_position_embeddings=MAX_MODEL_LEN
    )


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


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> RunningServer:
    """A real server on the tiny model, requiring ``API_KEY``."""
    from engine.engine import LLMEngine

    def factory():
        return LLMEngine.from_config(engine_config(tiny_model_dir))

    with RunningServer(factory, ServerOptions(api_keys=[API_KEY])) as running:
        yield running


@pytest.fixture()
def http(server) -> httpx.Client:
    with httpx.Client(
        base_url=server.base_url,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    ) as client:
        yield client


@pytest.fixture()
def client(server):
    import openai

    return openai.OpenAI(
        base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60
    )
