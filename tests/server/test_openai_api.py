"""The OpenAI-compatible API through the official ``openai`` client, on the real engine."""

from __future__ import annotations

import json

import openai
import pytest
from server_harness import API_KEY, MAX_MODEL_LEN

PROMPTS = ["Hello world", "The quick brown fox", "A paged KV cache", "def main():"]


def offline_greedy(llm, prompt, max_tokens, **kw):
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
    return llm.generate([prompt], params, use_tqdm=False)[0]


def ids_of(logprobs_tokens):
    return [int(t.removeprefix("token_id:")) for t in logprobs_tokens]


def test_models_version_health(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    spec = http.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= set(spec["paths"])


def test_completion_matches_offline_greedy(client, offline):
    for prompt in PROMPTS:
        ref = offline_greedy(offline, prompt, 12, ignore_eos=True).outputs[0]
        r = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        choice = r.choices[0]
        assert ids_of(choice.logprobs.tokens) == ref.token_ids
        assert choice.text == ref.text
        assert choice.finish_reason == "length"
        assert r.usage.completion_tokens == 12
        assert r.usage.prompt_tokens == len(offline.get_tokenizer()(prompt).input_ids)


def test_prompt_forms(client, http):
    tok = http.post("/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {
        "prompt": "<s>" + PROMPTS[0]
    }
    args = {"model": "tiny", "max_tokens": 6, "temperature": 0}
    by_text = client.completions.create(prompt=PROMPTS[0], **args).choices[0].text
    by_ids = client.completions.create(prompt=tok["tokens"], **args).choices[0].text
    assert by_ids == by_text
    # A list of strings and a list of token-id lists: choices in prompt order.
    many = client.completions.create(prompt=PROMPTS[:3], **args)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].text == by_text
    batch_ids = [tok["tokens"], tok["tokens"][:3]]
    both = client.completions.create(prompt=batch_ids, **args)
    assert both.choices[0].text == by_text and len(both.choices) == 2
    assert both.usage.prompt_tokens == len(tok["tokens"]) + 3


def test_echo_logprobs_for_loglikelihood(client, offline):
    """lm-eval's loglikelihood request: echo=True, logprobs=k, max_tokens=0 (or 1)."""
    prompt = PROMPTS[1]
    ref = offline_greedy(offline, prompt, 1, prompt_logprobs=2)
    n_prompt = len(ref.prompt_token_ids)
    r = client.completions.create(
        model="tiny", prompt=prompt, echo=True, logprobs=2, max_tokens=0, temperature=0
    )
    c = r.choices[0]
    assert c.text == prompt
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n_prompt):
        expected = ref.prompt_logprobs[i][ref.prompt_token_ids[i]].logprob
        assert lp.token_logprobs[i] == pytest.approx(expected, abs=1e-4)
        assert 2 <= len(lp.top_logprobs[i]) <= 3
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert r.usage.completion_tokens == 0

    one = client.completions.create(
        model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0
    ).choices[0]
    assert len(one.logprobs.tokens) == n_prompt + 1
    assert one.logprobs.token_logprobs[1:n_prompt] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert one.text.startswith(prompt)


def test_streaming_completion_matches_non_streaming(client, http):
    args = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0}
    full = client.completions.create(**args, extra_body={"ignore_eos": True})
    chunks = list(
        client.completions.create(
            **args,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    # The raw stream ends with data: [DONE].
    body = {**args, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_streaming_echo_with_logprobs(client):
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPTS[0],
            max_tokens=4,
            temperature=0,
            echo=True,
            logprobs=1,
            stream=True,
        )
    )
    text = "".join(c.choices[0].text for c in chunks)
    full = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True, logprobs=1
    ).choices[0]
    assert text == full.text
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert tokens == full.logprobs.tokens


def test_chat_matches_offline(client, offline):
    from engine.sampling_params import SamplingParams

    messages = [{"role": "user", "content": "What is a KV cache?"}]
    ref = offline.chat(
        messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    for limit in ({"max_tokens": 10}, {"max_completion_tokens": 10}):
        r = client.chat.completions.create(
            model="tiny", messages=messages, temperature=0, extra_body={"ignore_eos": True}, **limit
        )
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == ref.text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 10


def test_chat_logprobs_and_stream(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(values[0], abs=1e-5)
        assert entry.bytes == list(entry.token.encode())

    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=5,
            temperature=0,
            stream=True,
            logprobs=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    assert chunks[-1].usage.completion_tokens == 5


def test_n_completions_and_seed(client):
    args = dict(model="tiny", prompt=PROMPTS[3], max_tokens=8, temperature=1.0, n=3, seed=7)
    r = client.completions.create(**args, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 24
    again = client.completions.create(**args, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    streamed = {}
    for chunk in client.completions.create(**args, stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in r.choices}
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_stop_conditions_and_sampling_fields(client, offline):
    prompt = PROMPTS[0]
    ref = offline_greedy(offline, prompt, 12, ignore_eos=True).outputs[0]
    stop_token = ref.token_ids[3]
    r = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [stop_token], "ignore_eos": True},
    ).choices[0]
    assert r.finish_reason == "stop" and r.model_extra["stop_reason"] == stop_token
    stop_str = ref.text[len(ref.text) // 2 :][:2]
    if stop_str.strip() and "\ufffd" not in stop_str:
        s = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, stop=[stop_str]
        ).choices[0]
        assert stop_str not in s.text and s.finish_reason == "stop"
    # Every sampling field is accepted and honoured without error.
    ok = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=5,
        temperature=0.8,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={str(ref.token_ids[0]): -100},
        seed=1,
        user="someone",
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.2,
            "min_tokens": 5,
            "skip_special_tokens": False,
            "ignore_eos": False,
        },
    )
    assert ok.usage.completion_tokens == 5


def test_metrics_exposed(http, client):
    client.completions.create(model="tiny", prompt="metrics", max_tokens=3)
    text = http.get("/metrics").text
    for name in (
        "engine:num_requests_running",
        "engine:num_requests_waiting",
        "engine:kv_cache_usage_perc",
        "engine:prompt_tokens_total",
        "engine:generation_tokens_total",
        "engine:request_success_total",
        "engine:time_to_first_token_seconds_bucket",
        "engine:inter_token_latency_seconds_bucket",
        "engine:e2e_request_latency_seconds_count",
        "engine:prefix_cache_queries_total",
        "engine:prefix_cache_hits_total",
        "engine:num_preemptions_total",
    ):
        assert f"{name}{{" in text, name
    assert 'model_name="tiny"' in text
    assert 'finished_reason="length"' in text


def test_openai_client_errors(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x " * 400, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            top_logprobs=21,
            logprobs=True,
        )
    assert e.value.body["param"] == "top_logprobs"
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # Still serving.
    assert client.completions.create(model="tiny", prompt="x", max_tokens=1).choices


def test_chat_without_template_is_400(server, http):
    tokenizer = server.server.state.ctx.tokenizer
    saved = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    finally:
        tokenizer.chat_template = saved
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "chat_template_missing" and "no chat template" in err["message"]


def test_sse_error_envelope_is_json(http):
    """A streaming request refused up front is a plain JSON error, not an event stream."""
    r = http.post("/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": -5})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert json.loads(r.text)["error"]["param"] == "max_tokens"


def test_api_key_header_forms(server):
    import httpx

    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": API_KEY}).status_code == 401
        ok = c.get("/v1/models", headers={"Authorization": f"bearer {API_KEY}"})
        assert ok.status_code == 200
