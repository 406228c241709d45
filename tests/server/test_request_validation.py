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
