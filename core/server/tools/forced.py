"""Forced tool use: ``tool_choice: "required"`` or a named function.

The model is not trusted to pick the format here: the output is constrained by structured
outputs (guided decoding) to the JSON schema ``tool_choice_json_schema`` builds, so all of it is
the calls and no model-specific parser is needed (nor the server's tool flags). For
``"required"`` that is an array of ``{"name", "parameters"}`` objects; for a named function it
is the function's arguments object. ``ForcedToolCallParser`` reads such an output back into
calls, through the same stream interface as the model-format parsers; it shows nothing until
the choice ends, since the JSON is only complete then.
"""

from __future__ import annotations

import json
from typing import Any

from engine.server.tools.parser import StreamUpdate, ToolCall, ToolCallStream, ToolParser


def _parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def tool_choice_json_schema(
    tools: list[dict[str, Any]], tool_choice: str | dict[str, Any]
) -> dict[str, Any] | None:
    """The JSON schema the output must match when ``tool_choice`` forces tool use.

    ``"required"``: a non-empty array of ``{"name": <one of the tools>, "parameters": {...}}``
    whose parameters match that tool's schema (each tool's ``$defs`` are hoisted to the top,
    where ``$ref: "#/$defs/..."`` resolves). A named function: that function's parameters
    schema (the output is its arguments). ``"none"``/``"auto"``: None (nothing forced).
    ``tools`` must have passed ``validate_tools``; conflicting ``$defs`` raise ``ValueError``.
    """
    if tool_choice in ("none", "auto"):
        return None
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if isinstance(tool_choice, dict):
        return _parameters_schema(by_name[tool_choice["function"]["name"]])
    if tool_choice != "required":
        raise ValueError(f"unknown tool_choice {tool_choice!r}")
    defs: dict[str, Any] = {}
    variants = []
    for name, function in by_name.items():
        params = dict(_parameters_schema(function))
        for key, value in params.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise ValueError(f"tools define different $defs named {key!r}")
            defs[key] = value
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if defs:
        schema["$defs"] = defs
    return schema


def parse_forced_tool_calls(text: str, tool_choice: str | dict[str, Any]) -> list[ToolCall]:
    """The calls in an output generated under ``tool_choice_json_schema``: the array of
    ``{"name", "parameters"}`` for "required", the arguments object for a named function.
    Raises ``ValueError`` when the text is not such JSON."""
    value = json.loads(text)
    if isinstance(tool_choice, dict):
        if not isinstance(value, dict):
            raise ValueError("the arguments of a named tool call must be a JSON object")
        return [ToolCall(tool_choice["function"]["name"], json.dumps(value, ensure_ascii=False))]
    if not isinstance(value, list):
        raise ValueError('"required" tool calls must be a JSON array')
    calls = []
    for item in value:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
            raise ValueError('each "required" tool call must be {"name": ..., "parameters": ...}')
        calls.append(
            ToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))
        )
    return calls


class ForcedToolCallParser(ToolParser):
    """Reads the calls out of an output generated under ``tool_choice_json_schema``. An output
    that does not parse (cut short by ``max_tokens``, say) is returned as plain content."""

    name = "forced"

    def __init__(self, tool_choice: str | dict[str, Any]) -> None:
        self.tool_choice = tool_choice

    def stream(self) -> ToolCallStream:
        return _ForcedCallStream(self.tool_choice)


class _ForcedCallStream(ToolCallStream):
    def __init__(self, tool_choice: str | dict[str, Any]) -> None:
        self._tool_choice = tool_choice
        self._pieces: list[str] = []

    def feed(self, text: str) -> StreamUpdate:
        self._pieces.append(text)
        return StreamUpdate()

    def finish(self) -> StreamUpdate:
        text = "".join(self._pieces)
        self._pieces = []
        try:
            return StreamUpdate(calls=parse_forced_tool_calls(text, self._tool_choice))
        except ValueError:
            return StreamUpdate(content=text)
