"""The Qwen3-Coder tool-call format (``--tool-call-parser qwen3_coder``).

Calls sit in the Hermes tags, with XML-like bodies whose argument values are bare text::

    I'll check.
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is typed by the request's tool schema (``for_tools``), as the model's chat template
wrote it: ``string`` keeps the text; ``integer``, ``number``, ``boolean``, ``null``,
``object`` and ``array`` read it as JSON (a value that does not read that way stays text);
a parameter the schema does not describe is JSON when it reads as JSON, else text. One newline
after the opening tag and before the closing one is the template's, not the value's. A block
without ``<function=...>`` (or whose body does not read) is content, tags included, as with
``hermes``; content outside the blocks is handled the same way.
"""

from __future__ import annotations

import json
import re
from functools import partial
from typing import Any

from engine.server.tools.hermes import TaggedBlockStream
from engine.server.tools.parser import ToolCall, ToolCallStream, ToolParser

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(
    r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.DOTALL
)
_JSON_TYPES = ("integer", "number", "boolean", "null", "object", "array")


def _strip_template_newlines(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows (empty: not said)."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return {"string"}
    out: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            out |= _types(sub)
    return out


def _value(text: str, schema: Any) -> Any:
    types = _types(schema)
    if types == {"string"}:
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if not types or any(t in types for t in _JSON_TYPES):
        return value
    return text


def _call_from_body(body: str, schemas: dict[str, dict[str, Any]]) -> ToolCall | None:
    match = _FUNCTION.search(body)
    if match is None or body[: match.start()].strip():
        return None
    name = match.group(1).strip()
    if not name:
        return None
    properties = (schemas.get(name) or {}).get("properties") or {}
    arguments: dict[str, Any] = {}
    for param in _PARAMETER.finditer(match.group(2)):
        key = param.group(1).strip()
        arguments[key] = _value(_strip_template_newlines(param.group(2)), properties.get(key))
    return ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))


class Qwen3CoderToolParser(ToolParser):
    """``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>``
    (Qwen3-Coder)."""

    name = "qwen3_coder"
    needs_special_tokens = True

    def __init__(self, schemas: dict[str, dict[str, Any]] | None = None) -> None:
        self.schemas = schemas or {}

    def for_tools(self, tools: list[dict[str, Any]] | None) -> ToolParser:
        schemas = {
            t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or ()
        }
        return Qwen3CoderToolParser(schemas)

    def stream(self) -> ToolCallStream:
        return TaggedBlockStream(partial(_call_from_body, schemas=self.schemas))
