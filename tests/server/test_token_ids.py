"""Which token ids a request may name (issue 11, item 9): vLLM's rule, ids below
max(tokenizer size, model vocabulary), for prompt ids, ``logit_bias`` keys and
``stop_token_ids``, in the server and offline alike.

The model here has a padded vocabulary (more embedding rows than tokenizer tokens, as Qwen3
has 151,936 rows for 151,669 tokens): ids in the padding are valid and were refused.
"""

from __future__ import annotations

import httpx
import pytest
from server_harness import RunningServer, engine_config, error_of

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams

PADDING = 24


@pytest.fixture(scope="module")
def padded_model(tmp_path_factory):
    from transformers import AutoTokenizer

    from engine.testing.tiny_models import build_tiny_model, build_tokenizer

    out = tmp_path_factory.mktemp("padded-vocab")
    size = len(build_tokenizer(out))
    path = build_tiny_model(out, "llama", vocab_size=size + PADDING, max_position_embeddings=256)
    assert len(AutoTokenizer.from_pretrained(path)) == size
    return path, size


@pytest.fixture(scope="module")
def padded(padded_model):
    from engine.engine_core.core import EngineCore
    from engine.llm import LLM

    path, size = padded_model
    offline = LLM.from_engine_config(engine_config(path))
    with RunningServer(lambda: EngineCore.from_config(engine_config(path))) as server:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            yield http, offline, size, size + PADDING
    assert offline.llm_engine.num_used_blocks == 0


def test_ids_in_the_padding_are_valid_prompts(padded):
    http, offline, tok_size, vocab = padded
    prompt = [1, 5, tok_size, vocab - 1]  # the last two: rows the tokenizer has no token for
    r = http.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    ref = offline.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert r.json()["choices"][0]["text"] == ref.outputs[0].text


def test_logit_bias_and_stop_ids_in_the_padding_are_valid(padded):
    http, _, tok_size, vocab = padded
    body = {
        "prompt": "Hello",
        "max_tokens": 3,
        "logit_bias": {str(vocab - 1): 100},
        "stop_token_ids": [tok_size],
        "return_tokens_as_token_ids": True,
        "logprobs": 0,
        "temperature": 0,
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    # The +100 bias makes the padding row the greedy choice every step.
    assert r.json()["choices"][0]["logprobs"]["tokens"] == [f"token_id:{vocab - 1}"] * 3


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("prompt", "ids", "prompt"),
        ("logit_bias", "bias", "logit_bias"),
        ("stop_token_ids", [10**7], "stop_token_ids"),
        ("stop_token_ids", "ids", "stop_token_ids"),
    ],
)
def test_ids_beyond_both_are_400_with_the_range(padded, field, value, param):
    http, _, tok_size, vocab = padded
    body = {"prompt": "Hello", "max_tokens": 2}
    if value == "ids":
        value = [1, vocab]
    elif value == "bias":
        value = {str(vocab): 5}
    body[field] = value
    err = error_of(http.post("/v1/completions", json=body), 400)
    assert err["param"] == param, err
    assert f"token ids are integers in 0..{vocab - 1}" in err["message"], err
    assert f"tokenizer's {tok_size} tokens and the model's vocabulary of {vocab}" in err["message"]


@pytest.mark.parametrize("key", ["007", "+5", " 5", "5.0", "-1", "x"])
def test_logit_bias_keys_are_decimal_token_ids(padded, key):
    http, *_ = padded
    body = {"prompt": "Hello", "max_tokens": 2, "logit_bias": {key: 1}}
    err = error_of(http.post("/v1/completions", json=body), 400)
    assert err["param"] == "logit_bias" and "decimal" in err["message"], err


def test_detokenize_takes_ids_up_to_the_model_vocabulary(padded):
    http, _, tok_size, vocab = padded
    assert http.post("/detokenize", json={"tokens": [5, tok_size]}).status_code == 200
    err = error_of(http.post("/detokenize", json={"tokens": [5, vocab]}), 400)
    assert err["param"] == "tokens"


def test_offline_checks_the_same_ids(padded):
    _, offline, tok_size, vocab = padded
    engine = offline.llm_engine
    ok = SamplingParams(max_tokens=2, stop_token_ids=[vocab - 1], logit_bias={tok_size: 1.0})
    out = offline.generate({"prompt_token_ids": [1, tok_size]}, ok, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 1
    for prompt, params, param in [
        ([1, vocab], SamplingParams(max_tokens=2), "prompt"),
        ([1], SamplingParams(max_tokens=2, stop_token_ids=[10**7]), "stop_token_ids"),
        ([1], SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}), "logit_bias"),
    ]:
        with pytest.raises(InvalidRequestError) as err:
            offline.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        assert err.value.param == param
        assert f"0..{vocab - 1}" in str(err.value)
    assert not engine.has_unfinished_requests() and engine.num_used_blocks == 0


def test_tokenizer_larger_than_the_model(tmp_path):
    """A tokenizer token without an embedding row is refused by name, not by a crash."""
    from engine.llm_engine import LLMEngine
    from engine.testing.tiny_models import build_tiny_model, build_tokenizer

    size = len(build_tokenizer(tmp_path))
    path = build_tiny_model(tmp_path, "llama", vocab_size=size - 8, max_position_embeddings=256)
    engine = LLMEngine.from_config(engine_config(path))
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("r", None, SamplingParams(max_tokens=1), prompt_token_ids=[1, size - 2])
    assert err.value.param == "prompt" and "no row" in str(err.value)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("r", None, SamplingParams(max_tokens=1), prompt_token_ids=[1, size])
    assert f"0..{size - 1}" in str(err.value)
    assert engine.num_used_blocks == 0
