"""schemathesis hooks for tests/schemathesis/run.py: what a JSON schema cannot say.

The OpenAPI document (core/server/openapi.py) states every constraint on a single field. A
few rules relate fields to each other, to the prompt's length in tokens, or to whether a
regex, grammar or JSON schema compiles; the document says them in words and the server
answers 400 naming the field. A generated *positive* case (one schemathesis expects the
server to accept) may break such a rule; ``map_case`` below brings it within the rules the
way a client would, so that ``positive_data_acceptance`` checks everything else strictly.
Negative cases (expected to be refused) are left as generated.

Each repair names the rule it applies. The context budget asks the live server's
``/tokenize`` for the prompt's length, and caps the tokens to generate at a few, since the
run is about the API, not the model.
"""

from __future__ import annotations

import json
import os
import urllib.request
from typing import Any

import schemathesis
from schemathesis import GenerationMode

BASE_URL = os.environ["ENGINE_SCHEMATHESIS_URL"]
MAX_MODEL_LEN = int(os.environ["ENGINE_SCHEMATHESIS_MAX_MODEL_LEN"])
MAX_NEW_TOKENS = 4  # enough to exercise streaming, stops and logprobs; keeps the run short
STRUCTURED = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


@schemathesis.hook
def map_case(context, case):
    meta = case.meta
    if meta is None or meta.generation.mode != GenerationMode.POSITIVE:
        return case
    body = case.body
    if not isinstance(body, dict):
        return case
    if case.path == "/v1/completions":
        _completion(body)
    elif case.path == "/v1/chat/completions":
        _chat(body)
    elif case.path == "/tokenize" and "messages" in body:
        _messages(body)
    elif case.path == "/v1/embeddings":
        _embedding(body)
    elif case.path in ("/v1/messages", "/v1/messages/count_tokens"):
        _anthropic(body, generates=case.path == "/v1/messages")
    elif case.path == "/v1/responses":
        _responses(body)
    elif case.path in ("/score", "/v1/score"):
        _score(body)
    elif case.path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        _rerank(body)
    return case


# ---------------------------------------------------------------- the rules


def _sampling(body: dict[str, Any]) -> None:
    # At most one structured-outputs field, and one that compiles (the schema cannot say
    # whether a regex, grammar or JSON schema does).
    used = [name for name in STRUCTURED if _constrains(name, body.get(name))]
    for name in used[1:]:
        body.pop(name)
    if used:
        _compilable(used[0], body)
        body["min_tokens"] = 0  # min_tokens cannot combine with a grammar
    if body.get("stream") and body.get("prompt_logprobs") is not None:
        body.pop("prompt_logprobs")  # not available when streaming (vLLM's rule)
    if body.get("truncation_side") is not None and body.get("truncate_prompt_tokens") is None:
        body.pop("truncation_side")  # applies only with truncate_prompt_tokens
    if body.get("use_beam_search"):
        # Beam search returns no logprobs and does not stream (core/server/beam.py).
        body["stream"] = False
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            body.pop(name, None)


def _constrains(name: str, value: Any) -> bool:
    if value is None:
        return False
    if name == "response_format":
        return value.get("type", "text") != "text"
    return True


def _compilable(name: str, body: dict[str, Any]) -> None:
    if name == "response_format":
        spec = body[name].get("json_schema")
        if isinstance(spec, dict) and spec.get("schema") is not None:
            spec["schema"] = {"type": "object"}
    elif name == "structured_outputs":
        keep = {k: v for k, v in body[name].items() if k == "disable_any_whitespace"}
        body[name] = {**keep, "choice": ["yes", "no"]}
    elif name == "guided_json":
        body[name] = {"type": "object"}
    elif name == "guided_regex":
        body[name] = "[a-z]{1,8}"
    elif name == "guided_grammar":
        body[name] = 'root ::= "yes" | "no"'


def _budget(body: dict[str, Any], prompt_tokens: int, fields: tuple[str, ...]) -> None:
    """The prompt plus the tokens to generate fit the context; few tokens to generate."""
    keep = body.get("truncate_prompt_tokens")
    if keep is not None:
        prompt_tokens = min(prompt_tokens, MAX_MODEL_LEN if keep == -1 else keep)
    room = max(1, MAX_MODEL_LEN - prompt_tokens)
    for name in fields:
        value = body.get(name)
        if value is None and name == fields[0]:
            value = MAX_NEW_TOKENS  # "until the context is full" would take minutes
        if value is not None:
            lowest = 0 if name == "max_tokens" and _echo_only(body) else 1
            body[name] = max(lowest, min(value, room, MAX_NEW_TOKENS))
    limit = min(body[f] for f in fields if body.get(f) is not None)
    if body.get("min_tokens"):
        body["min_tokens"] = min(body["min_tokens"], limit)  # min_tokens <= max_tokens


def _echo_only(body: dict[str, Any]) -> bool:
    return bool(body.get("echo")) and body.get("max_tokens") == 0


def _completion(body: dict[str, Any]) -> None:
    _sampling(body)
    if body.get("best_of") is not None:
        body["best_of"] = body.get("n", 1)  # best_of must equal n
    if body.get("max_tokens") == 0 and not body.get("echo"):
        body["max_tokens"] = 1  # 0 only with echo
    prompt = body["prompt"]
    prompts = [prompt] if isinstance(prompt, str) or _is_ids(prompt) else prompt
    lengths = []
    for i, p in enumerate(prompts):
        n = len(p) if not isinstance(p, str) else _count(p, body.get("add_special_tokens", True))
        if n == 0 or n >= MAX_MODEL_LEN and body.get("truncate_prompt_tokens") is None:
            prompts[i] = "Hi" if isinstance(p, str) else [1, 5]  # a prompt of no tokens, or
            n = _count("Hi", True)  # one that cannot fit, is refused
        lengths.append(n)
    if not (isinstance(prompt, str) or _is_ids(prompt)):
        body["prompt"] = prompts
    else:
        body["prompt"] = prompts[0]
    _budget(body, max(lengths), ("max_tokens",))


def _is_ids(prompt: Any) -> bool:
    """One prompt of token ids (JSON integers; schemathesis may write them as 5.0)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (int, float))


def _chat(body: dict[str, Any]) -> None:
    _sampling(body)
    if body.get("top_logprobs") is not None:
        body["logprobs"] = True  # top_logprobs requires logprobs
    _messages(body)
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto") and any(body.get(n) is not None for n in STRUCTURED):
        # Forced tool calls constrain the output already: no second constraint.
        for name in STRUCTURED:
            body.pop(name, None)
    if choice not in (None, "none", "auto"):
        body["min_tokens"] = 0
    n = _count_chat(body)
    if n >= MAX_MODEL_LEN and body.get("truncate_prompt_tokens") is None:
        body["messages"] = [{"role": "user", "content": "Hi"}]
        body.pop("tools", None)
        body.pop("tool_choice", None)
        body["add_generation_prompt"], body["continue_final_message"] = True, False
        n = _count_chat(body)
    _budget(body, n, ("max_completion_tokens", "max_tokens"))


def _messages(body: dict[str, Any]) -> None:
    """Chat messages and tools within the rules the server checks beyond their types."""
    if body.get("continue_final_message"):
        body["add_generation_prompt"] = False  # the two cannot both be true
    for message in body["messages"]:
        content = message.get("content")
        if isinstance(content, list):
            # The served model is a text model: an image part is a 400 naming it.
            message["content"] = [
                p if p.get("type") != "image_url" else {"type": "text", "text": "an image"}
                for p in content
            ]
        calls = message.get("tool_calls")
        if calls is not None and message["role"] != "assistant":
            message.pop("tool_calls")  # only assistant messages make tool calls
            calls = None
        for call in calls or ():
            function = call["function"]
            if not isinstance(function.get("arguments", "{}"), dict):
                function["arguments"] = "{}"  # arguments must be a JSON text
        if message.get("content") is None and not calls:
            message["content"] = ""  # content is required unless the message made calls
        if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
            message["tool_call_id"] = "call_0"  # a tool message says which call it answers
    tools = body.get("tools")
    if tools:
        unique = {}
        for tool in tools:
            unique.setdefault(tool["function"]["name"], tool)  # tool names are unique
        body["tools"] = list(unique.values())
        for tool in body["tools"]:
            if tool["function"].get("parameters") is not None:
                tool["function"]["parameters"] = {"type": "object"}  # a schema that compiles
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if tools:
            choice["function"]["name"] = body["tools"][0]["function"]["name"]  # a given tool
        else:
            body.pop("tool_choice")
    elif choice in ("auto", "required") and not tools:
        body.pop("tool_choice")  # tool_choice needs tools


def _embedding(body: dict[str, Any]) -> None:
    """Each input fits the context (the prompt-length rule no JSON schema can state): one
    that does not, or that has no tokens, is replaced, as for completions."""
    value = body["input"]
    single = isinstance(value, str) or _is_ids(value)
    inputs = [value] if single else value
    for i, p in enumerate(inputs):
        n = len(p) if not isinstance(p, str) else _count(p, True)
        if n == 0 or n >= MAX_MODEL_LEN:
            inputs[i] = "Hi" if isinstance(p, str) else [1, 5]
    body["input"] = inputs[0] if single else inputs


def _anthropic(body: dict[str, Any], generates: bool) -> None:
    """Anthropic's Messages (and count_tokens): the same rules as the chat route's, in
    Anthropic's shapes. The server answers each broken rule with a 400 in Anthropic's
    envelope, which ``positive_data_acceptance`` would report as ST202."""
    tools = body.get("tools")
    if tools:
        unique = {}
        for tool in tools:
            unique.setdefault(tool["name"], tool)  # tool names are unique (no JSON schema
        body["tools"] = tools = list(unique.values())  # keyword compares one field of items)
        for tool in tools:
            tool["input_schema"] = {"type": "object"}  # a schema that compiles
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") != "none":
        if not tools:
            body.pop("tool_choice")  # tool_choice auto/any/tool needs tools
        elif choice["type"] == "tool":
            choice["name"] = tools[0]["name"]  # a tool that is given
    for message in body["messages"]:
        content = message["content"]
        if isinstance(content, list):
            for i, block in enumerate(content):
                if block["type"] == "image":
                    # The served model is a text model: an image is a 400 naming it.
                    content[i] = {"type": "text", "text": "an image"}
    n = _count_anthropic(body)
    if n >= MAX_MODEL_LEN - 1:
        # Over the context (or refused by the chat template): a prompt that fits.
        body["messages"] = [{"role": "user", "content": "Hi"}]
        for name in ("system", "tools", "tool_choice"):
            body.pop(name, None)
        n = _count_anthropic(body)
    if generates:
        body["max_tokens"] = max(1, min(body["max_tokens"], MAX_MODEL_LEN - n, MAX_NEW_TOKENS))


def _responses(body: dict[str, Any]) -> None:
    """OpenAI's Responses API: the chat route's rules, in its shapes (core/server/responses.py
    translates the request to a chat request, and the chat route's 400s follow)."""
    body.pop("previous_response_id", None)  # an id no response was kept under: a 404
    tools = body.get("tools") or []
    unique = {}
    for tool in tools:  # function tools with unique names and a schema that compiles
        if tool.get("type") == "function" and isinstance(tool.get("name"), str) and tool["name"]:
            unique.setdefault(tool["name"], {**tool, "parameters": {"type": "object"}})
    body["tools"] = list(unique.values())
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if body["tools"]:
            body["tool_choice"] = {"type": "function", "name": body["tools"][0]["name"]}
        else:
            body.pop("tool_choice")
    elif choice is not None and (choice not in ("auto", "none", "required") or not body["tools"]):
        body.pop("tool_choice")
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict):
        if fmt.get("type") == "json_schema":
            fmt["schema"] = {"type": "object"}  # a schema that compiles
        if body.get("tool_choice") not in (None, "none", "auto"):
            text.pop("format")  # forced tool calls constrain the output already
    if body.get("background"):
        body["background"] = False  # not served here (a 400)
    if body.get("truncation") == "auto":
        body["truncation"] = "disabled"  # not served here (a 400)
    items = body["input"]
    if isinstance(items, list):
        for item in items:
            kind = item.get("type", "message")
            if kind == "function_call":
                item["arguments"] = "{}"  # arguments must be a JSON text
            elif kind == "message" and isinstance(item.get("content"), list):
                # The served model is a text model: an image part is a 400 naming it.
                item["content"] = [
                    p if p.get("type") != "input_image" else {"type": "input_text", "text": "x"}
                    for p in item["content"]
                ]
            elif kind == "function_call_output" and isinstance(item.get("output"), list):
                item["output"] = "done"  # text only
        if not any(
            item.get("type", "message") == "message"
            or item.get("type") in ("function_call", "function_call_output")
            for item in items
        ):
            items.append({"role": "user", "content": "Hi"})  # something to answer
    if body.get("min_tokens"):
        body["min_tokens"] = 0 if body.get("tool_choice") not in (None, "none", "auto") else 1
    body["max_output_tokens"] = max(
        1, min(body.get("max_output_tokens") or MAX_NEW_TOKENS, MAX_NEW_TOKENS)
    )


def _score(body: dict[str, Any]) -> None:
    """The pairs are 1:N or N:N (lists of the same length)."""
    first, second = body["text_1"], body["text_2"]
    if isinstance(first, list) and len(first) > 1:
        second = second if isinstance(second, list) else [second]
        body["text_2"] = (second * len(first))[: len(first)]
    for name in ("text_1", "text_2"):
        texts = body[name] if isinstance(body[name], list) else [body[name]]
        fixed = [t if 0 < _count(t, True) < MAX_MODEL_LEN else "Hi" for t in texts]
        body[name] = fixed if isinstance(body[name], list) else fixed[0]


def _rerank(body: dict[str, Any]) -> None:
    """Every text fits the context."""
    if not 0 < _count(body["query"], True) < MAX_MODEL_LEN:
        body["query"] = "Hi"
    docs = body["documents"]
    for i, doc in enumerate(docs):
        text = doc if isinstance(doc, str) else doc.get("text")
        if not isinstance(text, str) or not 0 < _count(text, True) < MAX_MODEL_LEN:
            docs[i] = "Hi"


# ---------------------------------------------------------------- token counts


def _post(path: str, payload: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        BASE_URL + path,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.load(r)


def _count(text: str, add_special_tokens: bool) -> int:
    return _post("/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens})["count"]


def _count_chat(body: dict[str, Any]) -> int:
    fields = ("messages", "add_generation_prompt", "continue_final_message", "tools")
    payload = {k: body[k] for k in fields if body.get(k) is not None}
    if body.get("chat_template_kwargs") is not None:
        payload["chat_template_kwargs"] = body["chat_template_kwargs"]
    try:
        return _post("/tokenize", payload)["count"]
    except OSError:
        return MAX_MODEL_LEN  # the server refuses these messages: replaced above


def _count_anthropic(body: dict[str, Any]) -> int:
    fields = ("model", "messages", "system", "tools", "tool_choice")
    payload = {k: body[k] for k in fields if k in body}
    try:
        return _post("/v1/messages/count_tokens", payload)["input_tokens"]
    except OSError:
        return MAX_MODEL_LEN  # the server refuses these messages: replaced by the caller
