"""``engine serve --skip-tokenizer-init``: a model folder without tokenizer files is served;
token-id prompts work (tokens come back through ``logprobs`` with
``return_tokens_as_token_ids``, as with vLLM), everything that needs a tokenizer is a 400."""

from __future__ import annotations

import httpx
import pytest
from server_harness import RunningServer, engine_config

from engine.testing.tiny_models import save_tiny_model

PROMPT = [5, 17, 33, 9, 120]


@pytest.fixture(scope="module")
def no_tokenizer_dir(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("no-tok"), seed=4)


@pytest.fixture(scope="module")
def server(no_tokenizer_dir):
    from engine.engine_core.core import EngineCore

    def factory():
        config = engine_config(no_tokenizer_dir)
        config.model.skip_tokenizer_init = True
        return EngineCore.from_config(config)

    with RunningServer(factory) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def test_token_id_prompt_gives_tokens_and_empty_text(http, no_tokenizer_dir):
    from engine import LLM, SamplingParams

    body = {
        "prompt": PROMPT,
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == ""
    tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    offline = LLM(
        str(no_tokenizer_dir), dtype="float32", max_model_len=256, skip_tokenizer_init=True
    )
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    assert tokens == offline.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    assert r.json()["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stop": ["x"]}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ("/tokenize", {"prompt": "Hello"}, "prompt"),
        ("/detokenize", {"tokens": [1, 2]}, "tokens"),
    ],
    ids=["text-prompt", "stop", "chat", "tokenize", "detokenize"],
)
def test_what_needs_a_tokenizer_is_a_400(http, server, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert "skip-tokenizer-init" in error["message"] or "skip_tokenizer_init" in error["message"]
    assert server.engine.num_used_blocks == 0
