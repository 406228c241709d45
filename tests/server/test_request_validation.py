"""Request validation at the HTTP boundary (issue 11): what is not valid input is a 400 that
names the field and says what is allowed, never a 500, a silent coercion or a crash later on.

Bodies are sent as raw bytes where JSON can say what Python's ``json.dumps`` would not (lone
surrogate escapes, NaN)."""

from __future__ import annotations

import pytest
from server_harness import error_of, keep_alive_after

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def post_raw(http, path: str, body: str):
    """POST ``body`` verbatim (JSON text that may spell lone surrogates as escapes)."""
    return http.post(path, content=body.encode(), headers={"content-type": "application/json"})


# ---------------------------------------------------------------- item 1: lone surrogates

LONE = "\\ud800"  # JSON text: a lone high surrogate, as a client's JSON encoder may write it


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", f'{{"prompt": "a{LONE}b", "max_tokens": 3}}', "prompt"),
        ("/v1/completions", f'{{"prompt": ["ok", "a{LONE}"], "max_tokens": 3}}', "prompt.1"),
        ("/v1/completions", f'{{"prompt": "a", "stop": "x{LONE}"}}', "stop"),
        ("/v1/completions", f'{{"prompt": "a", "stop": ["ok", "{LONE}"]}}', "stop.1"),
        ("/v1/completions", f'{{"prompt": "a", "guided_regex": "a{LONE}"}}', "guided_regex"),
        ("/v1/completions", f'{{"prompt": "a", "logit_bias": {{"{LONE}": 1}}}}', "logit_bias"),
        (
            "/v1/chat/completions",
            f'{{"messages": [{{"role": "user", "content": "a{LONE}b"}}]}}',
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            f'{{"messages": [{{"role": "user", "content": "a{LONE}b"}}], "stream": true}}',
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
            "messages.0.content.0.text",
        ),
        (
            "/v1/chat/completions",
            f'{{"messages": [{{"role": "user", "content": "hi", "name": "{LONE}"}}]}}',
            "messages.0.name",
        ),
        (
            "/v1/chat/completions",
            f'{{"messages": [{{"role": "user", "content": "hi"}}], "tools": [{{"type": '
            f'"function", "function": {{"name": "f", "description": "{LONE}"}}}}]}}',
            "tools.0.function.description",
        ),
        (
            "/v1/chat/completions",
            f'{{"messages": [{{"role": "user", "content": "hi"}}], '
            f'"chat_template_kwargs": {{"x": "{LONE}"}}}}',
            "chat_template_kwargs.x",
        ),
        ("/tokenize", f'{{"prompt": "a{LONE}b"}}', "prompt"),
        (
            "/tokenize",
            f'{{"messages": [{{"role": "user", "content": "{LONE}"}}]}}',
            "messages.0.content",
        ),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(http, path, body, param):
    err = error_of(post_raw(http, path, body), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert "lone UTF-16 surrogate" in err["message"], err


def test_paired_surrogates_are_one_character_and_fine(http):
    """``\\ud83d\\ude00`` is the JSON spelling of one emoji, not two lone halves."""
    r = post_raw(http, "/v1/completions", '{"prompt": "a\\ud83d\\ude00", "max_tokens": 2}')
    assert r.status_code == 200, r.text
    tok = post_raw(http, "/tokenize", '{"prompt": "a\\ud83d\\ude00"}').json()
    assert tok["tokens"] == http.post("/tokenize", json={"prompt": "a\U0001f600"}).json()["tokens"]


def test_lone_surrogate_leaves_the_connection_usable(server):
    """The issue's reproducer: a lone surrogate, then a valid request on the same socket."""
    err = keep_alive_after(server, f'{{"prompt": "a{LONE}"}}', 400)
    assert err["param"] == "prompt"


# ---------------------------------------------------------------- item 3: model names


def test_unknown_model_that_cannot_be_encoded_is_404(http):
    """An unknown name is a 404 whatever its characters: the error quotes it with the lone
    surrogate escaped (it was a 400 "'utf-8' codec can't encode..." with param null, from
    rendering the error itself)."""
    for path, body in (
        ("/v1/completions", f'{{"prompt": "x", "model": "{LONE}"}}'),
        (
            "/v1/chat/completions",
            f'{{"messages": [{{"role": "user", "content": "x"}}], "model": "a{LONE}"}}',
        ),  # fmt: skip
        ("/tokenize", f'{{"prompt": "x", "model": "{LONE}"}}'),
        ("/detokenize", f'{{"tokens": [1], "model": "{LONE}"}}'),
    ):
        r = post_raw(http, path, body)
        err = error_of(r, 404)
        assert err["code"] == "model_not_found" and err["param"] == "model", err
        assert "\\ud800` does not exist" in err["message"], err
        assert "Served models: tiny" in err["message"]


# ---------------------------------------------------------------- item 4: NaN, infinity, huge

FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e308"])
def test_non_finite_floats_are_400_naming_the_field(http, path, name, value):
    """Python's JSON parser reads NaN and Infinity; NaN was accepted and sampled token 0 every
    step, Infinity and 1e308 were accepted too."""
    head = (
        '"prompt": "hi"'
        if path == "/v1/completions"
        else '"messages": [{"role": "user", "content": "hi"}]'
    )
    r = post_raw(http, path, f'{{{head}, "max_tokens": 2, "{name}": {value}}}')
    err = error_of(r, 400)
    assert err["param"] == name, err
    assert err["message"].startswith(f"{name}: must be"), err


@pytest.mark.parametrize("value", ["NaN", "Infinity", "1e308"])
def test_non_finite_logit_bias_is_400(http, value):
    r = post_raw(http, "/v1/completions", f'{{"prompt": "hi", "logit_bias": {{"5": {value}}}}}')
    assert error_of(r, 400)["param"] == "logit_bias.5"


def test_integral_json_numbers_are_integers(http):
    """JSON has one number type: 2.0 is the integer 2 (as JSON Schema reads it too)."""
    r = post_raw(http, "/v1/completions", '{"prompt": [1, 5.0], "max_tokens": 2.0, "n": 1.0}')
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_integral_numbers_are_still_floats(http):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 1})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- item 5: no coercion


@pytest.mark.parametrize(
    "path, body, param, message",
    [
        ("/v1/completions", '{"prompt": "x", "max_tokens": "5"}', "max_tokens",
         "max_tokens: expected an integer, got a string"),
        ("/v1/completions", '{"prompt": "x", "max_tokens": true}', "max_tokens",
         "max_tokens: expected an integer, got a boolean"),
        ("/v1/completions", '{"prompt": "x", "max_tokens": 5.5}', "max_tokens",
         "max_tokens: expected an integer, got a number"),
        ("/v1/completions", '{"prompt": "x", "stream": "yes"}', "stream",
         "stream: expected a boolean, got a string"),
        ("/v1/completions", '{"prompt": "x", "echo": 1}', "echo",
         "echo: expected a boolean, got an integer"),
        ("/v1/completions", '{"prompt": [true, false]}', "prompt.0",
         "prompt.0: expected an integer, got a boolean"),
        ("/v1/completions", '{"prompt": [[1, true]]}', "prompt.0.1",
         "prompt.0.1: expected an integer, got a boolean"),
        ("/v1/completions", '{"prompt": ["a", 5]}', "prompt.1",
         "prompt.1: expected a string, got an integer"),
        ("/v1/completions", '{"prompt": "x", "logprobs": true}', "logprobs",
         "logprobs: expected an integer, got a boolean"),
        ("/v1/completions", '{"prompt": "x", "temperature": "0.5"}', "temperature",
         "temperature: expected a number, got a string"),
        ("/v1/completions", '{"prompt": "x", "stop_token_ids": ["5"]}', "stop_token_ids.0",
         "stop_token_ids.0: expected an integer, got a string"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], '
         '"logprobs": 1}', "logprobs", "logprobs: expected a boolean, got an integer"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": 5}]}',
         "messages.0.content", "messages.0.content: expected a string, got an integer"),
        ("/detokenize", '{"tokens": [false]}', "tokens.0",
         "tokens.0: expected an integer, got a boolean"),
        ("/tokenize", '{"prompt": "x", "add_special_tokens": "no"}', "add_special_tokens",
         "add_special_tokens: expected a boolean, got a string"),
    ],
)  # fmt: skip
def test_wrong_types_are_not_coerced(http, path, body, param, message):
    err = error_of(post_raw(http, path, body), 400)
    assert err["param"] == param, err
    assert err["message"].startswith(message), err


# ---------------------------------------------------------------- item 6: messages


@pytest.mark.parametrize(
    "path, field",
    [
        ("/v1/completions", "prompt"),
        ("/v1/chat/completions", "messages"),
        ("/tokenize", "prompt"),
        ("/detokenize", "tokens"),
    ],
)
def test_empty_body_names_the_required_field(http, path, field):
    for content in (b"", b"{}"):
        err = error_of(http.post(path, content=content), 400)
        assert err["param"] == field, err
        assert err["message"].startswith(f"{field}: this field is required"), err


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"prompt": "x", "seed": 2**70}, "seed",
         f"seed: must be at most {2**63 - 1}, got {2**70}"),
        ({"prompt": "x", "seed": -(2**64)}, "seed",
         f"seed: must be at least {-(2**63)}, got {-(2**64)}"),
        ({"prompt": "x", "top_p": 0}, "top_p", "top_p: must be at least 1.175494e-38, got 0"),
        # Positive, but zero in float32: masked logits would become NaN (-inf * 0).
        ({"prompt": "x", "repetition_penalty": 5e-324}, "repetition_penalty",
         "repetition_penalty: must be at least 1.175494e-38, got 4.940656e-324"),
        ({"prompt": "x", "n": 0}, "n", "n: must be at least 1, got 0"),
        ({"prompt": "x", "n": 129}, "n", "n must be in [1, 128], got 129"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "logprobs must be in [0, 20], got 21"),
        ({"prompt": []}, "prompt", "prompt: must have at least 1 item"),
        ({"prompt": "x", "suffix": "y"}, "suffix", "suffix: not supported"),
    ],
)  # fmt: skip
def test_messages_name_the_field_and_the_allowed_range(http, body, param, message):
    err = error_of(http.post("/v1/completions", json=body), 400)
    assert err["param"] == param, err
    assert err["message"].startswith(message), err


def test_tokenize_errors_name_the_field_not_a_class(http):
    err = error_of(http.post("/tokenize", json={}), 400)
    assert err["param"] == "prompt" and "Request" not in err["message"], err
    err = error_of(http.post("/tokenize", json={"messages": [{"content": "x"}]}), 400)
    assert err["param"] == "messages.0.role" and "Request" not in err["message"], err


def test_chat_top_logprobs_limit_names_top_logprobs(http):
    body = {**CHAT, "logprobs": True, "top_logprobs": 21}
    err = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == "top_logprobs"
    assert err["message"] == "top_logprobs must be in [0, 20], got 21"
