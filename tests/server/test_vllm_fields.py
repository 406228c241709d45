"""vLLM's request fields that were accepted and ignored (issue 11, item 7): ``prompt_logprobs``,
``truncate_prompt_tokens``, a per-request ``chat_template``, chat ``echo``; and what a chat
request must be for its template: roles the template renders, content where OpenAI wants it,
no ``tool_calls`` key without tool calls. Compared with the offline engine on the same weights.
"""

from __future__ import annotations

import json

import pytest
from server_harness import error_of

from engine.sampling_params import SamplingParams

USER = [{"role": "user", "content": "What is a KV cache?"}]
# A template with a fixed set of roles: anything else is silently dropped by the if/elif.
STRICT_ROLES = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'system' %}<|system|>{{ m['content'] }}<|end|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture()
def trusted(server, monkeypatch):
    """The session server, running request chat templates (--trust-request-chat-template)."""
    monkeypatch.setattr(server.server.state.ctx.templates, "trust_request_template", True)


def greedy(offline, ids, max_tokens, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return offline.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]


def tokens_of(http, text, add_special_tokens=True):
    body = {"prompt": text, "add_special_tokens": add_special_tokens}
    return http.post("/tokenize", json=body).json()["tokens"]


# ---------------------------------------------------------------- prompt_logprobs


def check_prompt_logprobs(got, ref, k):
    assert len(got) == len(ref.prompt_token_ids) and got[0] is None
    for i in range(1, len(got)):
        token = ref.prompt_token_ids[i]
        entry = got[i]
        assert str(token) in entry and len(entry) <= k + 1
        expected = ref.prompt_logprobs[i]
        for key, value in entry.items():
            assert set(value) == {"logprob", "rank", "decoded_token"}
            assert value["logprob"] == pytest.approx(expected[int(key)].logprob, abs=1e-4)
            assert isinstance(value["rank"], int) and isinstance(value["decoded_token"], str)
        assert entry[str(token)]["rank"] == expected[token].rank


def test_completion_prompt_logprobs(http, offline):
    ids = tokens_of(http, "The quick brown fox")
    ref = greedy(offline, ids, 2, prompt_logprobs=2)
    r = http.post(
        "/v1/completions",
        json={"prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2,
              "ignore_eos": True},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    check_prompt_logprobs(choice["prompt_logprobs"], ref, 2)
    assert choice["logprobs"] is None  # the completion's own logprobs were not asked for
    # Without the field: null, as vLLM answers.
    plain = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None


def test_chat_prompt_logprobs(http, offline):
    body = {"messages": USER, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    rendered = http.post("/tokenize", json={"messages": USER}).json()["tokens"]
    check_prompt_logprobs(
        r.json()["prompt_logprobs"], greedy(offline, rendered, 1, prompt_logprobs=1), 1
    )


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_logprobs_cannot_stream(http, path):
    body = {"prompt_logprobs": 1, "stream": True, "max_tokens": 2}
    body |= {"prompt": "x"} if path == "/v1/completions" else {"messages": USER}
    assert error_of(http.post(path, json=body), 400)["param"] == "prompt_logprobs"


def test_prompt_logprobs_over_the_limit(http):
    body = {"prompt": "x", "prompt_logprobs": 21}
    err = error_of(http.post("/v1/completions", json=body), 400)
    assert err["param"] == "prompt_logprobs" and "[0, 20]" in err["message"]


# ---------------------------------------------------------------- truncate_prompt_tokens


def test_truncate_prompt_tokens_keeps_the_last_tokens(http, offline):
    ids = tokens_of(http, "A paged KV cache stores keys and values in fixed-size blocks")
    assert len(ids) > 8
    args = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": 5, **args})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == 5
    assert body["choices"][0]["text"] == greedy(offline, ids[-5:], 4).outputs[0].text
    # truncation_side "right" keeps the first ones; a text prompt is truncated the same way.
    text = "A paged KV cache stores keys and values in fixed-size blocks"
    right = http.post(
        "/v1/completions",
        json={"prompt": text, "truncate_prompt_tokens": 5, "truncation_side": "right",
              "echo": True, **args},
    ).json()  # fmt: skip
    assert right["usage"]["prompt_tokens"] == 5
    first = greedy(offline, ids[:5], 4).outputs[0].text
    # echo shows the tokens kept, not the whole text.
    assert right["choices"][0]["text"] == offline.get_tokenizer().decode(ids[:5]) + first
    # Shorter than the limit: unchanged.
    same = http.post("/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": 200, **args})
    assert same.json()["usage"]["prompt_tokens"] == len(ids)


def test_truncate_prompt_tokens_in_chat(http, offline):
    rendered = http.post("/tokenize", json={"messages": USER}).json()["tokens"]
    body = {"messages": USER, "truncate_prompt_tokens": 4, "max_tokens": 3, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = http.post("/v1/chat/completions", json=body).json()
    assert r["usage"]["prompt_tokens"] == 4
    assert (
        r["choices"][0]["message"]["content"] == greedy(offline, rendered[-4:], 3).outputs[0].text
    )


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"truncate_prompt_tokens": 10_000}, "truncate_prompt_tokens"),  # > max_model_len
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncation_side": "right"}, "truncation_side"),  # without truncate_prompt_tokens
        ({"truncate_prompt_tokens": 3, "truncation_side": "middle"}, "truncation_side"),
    ],
)
def test_truncate_prompt_tokens_errors(http, extra, param):
    err = error_of(http.post("/v1/completions", json={"prompt": "hello", **extra}), 400)
    assert err["param"] == param, err


# ---------------------------------------------------------------- per-request chat_template

BRACKETS = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}[bot]{{ greeting | default('') }}{% endif %}"
)


def test_request_chat_template_is_refused_unless_trusted(http):
    for path in ("/v1/chat/completions", "/tokenize"):
        body = {"messages": USER, "chat_template": BRACKETS, "max_tokens": 2}
        err = error_of(http.post(path, json=body), 400)
        assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]
        # vLLM also reads it from chat_template_kwargs.
        body = {"messages": USER, "chat_template_kwargs": {"chat_template": BRACKETS}}
        assert error_of(http.post(path, json=body), 400)["param"] == "chat_template"


def test_request_chat_template_renders_the_prompt(http, offline, trusted):
    body = {"messages": USER, "chat_template": BRACKETS,
            "chat_template_kwargs": {"greeting": "Sure:"}}  # fmt: skip
    tokens = http.post("/tokenize", json=body).json()["tokens"]
    expected = "[user]What is a KV cache?[bot]Sure:"
    assert tokens == tokens_of(http, expected, add_special_tokens=False)
    r = http.post(
        "/v1/chat/completions",
        json={**body, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    ).json()
    assert r["usage"]["prompt_tokens"] == len(tokens)
    assert r["choices"][0]["message"]["content"] == greedy(offline, tokens, 4).outputs[0].text
    # The server's template still serves requests without one.
    default = http.post("/tokenize", json={"messages": USER}).json()["tokens"]
    assert default != tokens


def test_request_chat_template_that_does_not_compile(http, trusted):
    body = {"messages": USER, "chat_template": "{% for m in messages %}"}
    err = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == "chat_template" and "the chat template failed" in err["message"]


# ---------------------------------------------------------------- echo


def test_echo_continues_the_last_message_of_the_same_role(http):
    """vLLM: with echo, the response starts with the last message's content when that message
    has the response's role: the assistant's after a generation prompt, else the last
    author's (whose message the model continues)."""
    args = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    prefill = [*USER, {"role": "assistant", "content": "A KV cache"}]
    cont = {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True}
    plain = http.post("/v1/chat/completions", json={**cont, **args}).json()
    echoed = http.post("/v1/chat/completions", json={**cont, **args, "echo": True}).json()
    message = echoed["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert message["content"] == "A KV cache" + plain["choices"][0]["message"]["content"]

    # Continuing the user's own message: the response is the user's, echoed from its start.
    user_cont = {"messages": USER, "add_generation_prompt": False, "continue_final_message": True}
    plain = http.post("/v1/chat/completions", json={**user_cont, **args}).json()
    echoed = http.post("/v1/chat/completions", json={**user_cont, **args, "echo": True}).json()
    message = echoed["choices"][0]["message"]
    assert message["role"] == "user"
    assert message["content"] == USER[0]["content"] + plain["choices"][0]["message"]["content"]

    # After a generation prompt the response is the assistant's: a user message is not echoed.
    fresh = http.post("/v1/chat/completions", json={"messages": USER, "echo": True, **args}).json()
    assert not fresh["choices"][0]["message"]["content"].startswith(USER[0]["content"])


def test_echo_streams_first(http):
    body = {"messages": USER, "add_generation_prompt": False, "continue_final_message": True,
            "echo": True, "stream": True, "max_tokens": 3, "temperature": 0}  # fmt: skip
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = events[0]["choices"][0]["delta"]
    assert first == {"role": "user", "content": USER[0]["content"]}


# ---------------------------------------------------------------- roles and content


def test_roles_the_template_renders_are_accepted(http):
    """The tiny model's template writes any role (<|wizard|>...): vLLM leaves roles to the
    template, and so does the server."""
    body = {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_roles_the_template_drops_are_400(http, trusted):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "wizard", "content": "hi"},
        {"role": "user", "content": "hello"},
    ]
    for path in ("/v1/chat/completions", "/tokenize"):
        body = {"messages": messages, "chat_template": STRICT_ROLES, "max_tokens": 2}
        err = error_of(http.post(path, json=body), 400)
        assert err["param"] == "messages.1.role", err
        assert "does not take the role 'wizard'" in err["message"]
    ok = [messages[0], messages[2]]
    body = {"messages": ok, "chat_template": STRICT_ROLES, "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    # Asked again (the answer is cached per template and conversation shape): still refused.
    body = {"messages": messages, "chat_template": STRICT_ROLES, "max_tokens": 2}
    assert error_of(http.post("/v1/chat/completions", json=body), 400)["param"] == "messages.1.role"


def test_template_that_raises_on_a_role(http, trusted):
    template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('Only user and assistant roles are supported') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    body = {"messages": [{"role": "wizard", "content": "hi"}], "chat_template": template}
    err = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert "Only user and assistant roles are supported" in err["message"]


def test_empty_role_is_400(http):
    body = {"messages": [{"role": "", "content": "hi"}]}
    assert error_of(http.post("/v1/chat/completions", json=body), 400)["param"] == "messages.0.role"


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user"},
        {"role": "user", "content": None},
        {"role": "system", "content": None},
        {"role": "assistant", "content": None},  # neither content nor tool calls
    ],
)
def test_missing_content_is_400(http, message):
    messages = [message] if message["role"] != "assistant" else [*USER, message]
    index = len(messages) - 1
    for path in ("/v1/chat/completions", "/tokenize"):
        err = error_of(http.post(path, json={"messages": messages}), 400)
        assert err["param"] == f"messages.{index}.content", err
        assert "is required" in err["message"]


def test_empty_string_content_is_content(http):
    body = {"messages": [{"role": "user", "content": ""}], "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


# ---------------------------------------------------------------- tool_calls


def test_no_tool_calls_key_without_tool_calls(http, client):
    r = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
    assert "tool_calls" not in r.json()["choices"][0]["message"]
    reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    assert reply.choices[0].message.tool_calls is None


def test_trust_request_chat_template_flag():
    from engine.cli.main import build_parser

    assert build_parser().parse_args(["serve", "/m"]).trust_request_chat_template is False
    args = build_parser().parse_args(["serve", "/m", "--trust-request-chat-template"])
    assert args.trust_request_chat_template is True
