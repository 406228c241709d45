"""Serving a ``Gemma3ForConditionalGeneration`` checkpoint: text chat works; a message with an
image part is a 400 with an OpenAI error body (images are not supported), and the server keeps
serving."""

from __future__ import annotations

import httpx
import pytest
from server_harness import RunningServer, engine_config

IMAGE = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"


@pytest.fixture(scope="module")
def gemma3mm_server(tmp_path_factory):
    from engine.engine_core.core import EngineCore
    from engine.testing.tiny_models import build_tiny_gemma3_multimodal

    path = build_tiny_gemma3_multimodal(tmp_path_factory.mktemp("gemma3mm-server"))
    with RunningServer(lambda: EngineCore.from_config(engine_config(path))) as running:
        yield running


def test_image_part_is_400_and_text_chat_works(gemma3mm_server):
    with httpx.Client(base_url=gemma3mm_server.base_url, timeout=60) as http:
        content = [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": IMAGE}},
        ]
        r = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": content}], "max_tokens": 4},
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert "only text parts are supported" in err["message"]
        assert "image_url" in err["message"]

        ok = http.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                "max_tokens": 4,
                "temperature": 0,
            },
        )
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] >= 1
    assert gemma3mm_server.engine.num_used_blocks == 0
