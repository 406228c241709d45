"""Fixtures for the server tests: a real uvicorn server on 127.0.0.1 and a free port.

The model is a tiny random Llama with a trained BPE tokenizer and a chat template, written to a
temporary directory once per session; the server runs in a thread of the test process so that
tests can look at the engine (``num_used_blocks``) directly.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server_harness import API_KEY, MAX_MODEL_LEN, RunningServer, engine_config

from engine.server.app import ServerOptions


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from engine.testing.tiny_models import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-llama"), "llama", max_position_embeddings=MAX_MODEL_LEN
    )


@pytest.fixture(scope="session")
def server(tiny_model_dir) -> RunningServer:
    """A real server on the tiny model, requiring ``API_KEY`` (loaded once per session)."""
    from engine.engine_core.core import EngineCore

    def factory():
        return EngineCore.from_config(engine_config(tiny_model_dir))

    with RunningServer(factory, ServerOptions(api_keys=[API_KEY])) as running:
        yield running


@pytest.fixture(scope="session")
def offline(tiny_model_dir):
    """The offline ``LLM`` on the same model: the reference for exact tokens."""
    from engine.llm import LLM

    return LLM.from_engine_config(engine_config(tiny_model_dir))


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
