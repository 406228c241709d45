"""What a Responses request asks for, in the chat route's terms: its ``input`` items (and a
kept conversation) as chat messages, its fields as a ``ChatCompletionRequest``, and its input
as the items ``GET /v1/responses/{id}/input_items`` lists. ``engine.server.responses`` serves
the translated request; the mapping is described there."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from engine.server.errors import APIError, bad_request, validation_error
from engine.server.protocol import ChatCompletionRequest
from engine.server.responses_protocol import (
    INPUT_ITEM,
    PASSED_FIELDS,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputImage,
    ItemReference,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"


def new_id(prefix: str) -> str:
    """An item or response id like OpenAI's (``resp_...``, ``msg_...``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------- the conversation


class Conversation:
    """The chat messages of a request, and where each came from in the request (so that an
    error the chat path raises about ``messages.3`` names ``input.2`` instead)."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.origins: list[str] = []

    def add(self, message: dict[str, Any], origin: str) -> None:
        self.messages.append(message)
        self.origins.append(origin)

    def rename(self, err: APIError) -> APIError:
        """``err`` with a ``messages.N`` parameter (and message prefix) put in the request's
        terms."""
        param = err.param or ""
        if not param.startswith("messages."):
            return err
        head, _, rest = param.removeprefix("messages.").partition(".")
        if not head.isdigit() or int(head) >= len(self.origins):
            return err
        old = f"messages.{head}"
        new = self.origins[int(head)]
        err.param = new + ("." + rest if rest else "")
        err.message = err.message.replace(old, new, 1)
        return err


def _text_of_parts(parts: list[Any], where: str) -> str:
    """The text of text parts (a ``function_call_output``'s list form)."""
    texts = []
    for k, part in enumerate(parts):
        if isinstance(part, InputImage):
            raise bad_request(
                f"{where}.{k}: a function_call_output takes text here, not images",
                f"{where}.{k}.type",
            )
        texts.append(part.refusal if part.type == "refusal" else part.text)
    return "".join(texts)


def _content(item: MessageItem, where: str) -> str | list[dict[str, Any]]:
    if isinstance(item.content, str):
        return item.content
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(item.content):
        at = f"{where}.content.{k}"
        if isinstance(part, InputImage):
            if item.role != "user":
                raise bad_request(f"{at}: only user messages take images", f"{at}.type")
            if part.image_url is None:
                raise bad_request(
                    f"{at}: uploaded files (file_id) are not kept by this server; send the "
                    "image as image_url (a URL or a data: URL)",
                    f"{at}.file_id",
                )
            url: dict[str, Any] = {"url": part.image_url}
            if part.detail is not None:
                url["detail"] = part.detail
            parts.append({"type": "image_url", "image_url": url})
        elif part.type == "refusal":
            parts.append({"type": "text", "text": part.refusal})
        else:
            parts.append({"type": "text", "text": part.text})
    return parts


def add_input(
    conv: Conversation,
    body: ResponsesRequest,
    lookup: Callable[[str], dict[str, Any] | None] = lambda item_id: None,
) -> None:
    """The chat messages of ``body.input``; ``lookup`` finds a kept item by id (an
    ``item_reference``; a 404 naming the item when it is not kept)."""
    if isinstance(body.input, str):
        conv.add({"role": "user", "content": body.input}, "input")
        return
    for j, item in enumerate(body.input):
        where = f"input.{j}"
        if isinstance(item, ItemReference):
            found = lookup(item.id)
            if found is None:
                raise APIError(
                    404,
                    f"{where}: no kept item with id {item.id!r} (items of responses this front "
                    "end keeps can be referenced)",
                    param=f"{where}.id",
                )
            item = INPUT_ITEM.validate_python(found)
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            conv.add({"role": role, "content": _content(item, where)}, where)
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = conv.messages[-1] if conv.messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                conv.add({"role": "assistant", "content": None, "tool_calls": [call]}, where)
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output
            if not isinstance(output, str):
                output = _text_of_parts(output, f"{where}.output")
            conv.add({"role": "tool", "tool_call_id": item.call_id, "content": output}, where)
        elif isinstance(item, ReasoningItem):
            continue  # earlier reasoning stays out of the prompt (module docstring)


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items with ids (``GET .../input_items``)."""
    if isinstance(body.input, str):
        items = [{"type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": body.input}]}]  # fmt: skip
    else:
        items = [
            item.model_dump(mode="json", by_alias=True, exclude_none=True) for item in body.input
        ]
    out = []
    for item in items:
        item = dict(item)
        kind = item.setdefault("type", "message")
        if kind == "message":
            if isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
            item.setdefault("status", "completed")
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                  "reasoning": "rs"}.get(kind, "item")  # fmt: skip
        item.setdefault("id", new_id(prefix))
        out.append(item)
    return out


# ---------------------------------------------------------------- the chat request


def _function_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(
                f"{where}.type: this server runs function tools only (type 'function'), got "
                f"{kind!r}; hosted tools (web search, file search, code interpreter, MCP...) "
                "are OpenAI's",
                f"{where}.type",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}.name: a function tool needs a name", f"{where}.name")
        function = {"name": name}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # "auto", "none", "required" (anything else: the chat path's 400)
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("tool_choice: a function choice needs a name", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    raise bad_request(
        f"tool_choice.type: 'function' (or the strings 'auto', 'none', 'required') is taken "
        f"here, got {kind!r}",
        "tool_choice.type",
    )


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise bad_request("text.format.schema: a json_schema format needs its schema",
                          "text.format.schema")  # fmt: skip
    schema: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema_}
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    if fmt.description is not None:
        schema["description"] = fmt.description
    return {"type": "json_schema", "json_schema": schema}


def chat_request_of(body: ResponsesRequest, conv: Conversation) -> ChatCompletionRequest:
    """The chat path's request for a Responses request over ``conv``."""
    if body.background:
        raise bad_request("background responses are not supported here", "background")
    if body.truncation == "auto":
        raise bad_request(
            "truncation 'auto' is not supported: the conversation must fit the model's "
            "context ('disabled', the default)",
            "truncation",
        )
    if not conv.messages:
        raise bad_request("input has no message to answer", "input")
    data: dict[str, Any] = {
        "model": body.model,
        "messages": conv.messages,
        "stream": body.stream,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.max_output_tokens is not None:
        data["max_completion_tokens"] = body.max_output_tokens
    for name in PASSED_FIELDS:
        value = getattr(body, name)
        if value is not None:
            data[name] = value
    if body.tools:
        data["tools"] = _function_tools(body.tools)
    if body.tool_choice is not None:
        data["tool_choice"] = _tool_choice(body.tool_choice)
    response_format = _response_format(body)
    if response_format is not None:
        data["response_format"] = response_format
    kwargs = dict(body.chat_template_kwargs or {})
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
    if kwargs:
        data["chat_template_kwargs"] = kwargs
    if body.include and LOGPROBS_INCLUDE in body.include:
        data["logprobs"] = True
        data["top_logprobs"] = body.top_logprobs or 0
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as e:  # a passed-through field the chat path refuses
        raise validation_error(e.errors()) from None
