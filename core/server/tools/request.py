"""The tool fields of a chat request: validation, what the template sees, what is parsed.

``plan_tool_use`` checks ``tools`` and ``tool_choice`` (a 400 naming the field for anything
malformed) and decides, with the server's flags, which tools reach the chat template and
which parser reads the output. ``prepare_tool_history`` shapes assistant ``tool_calls`` and
``tool`` messages of the conversation the way Hugging Face chat templates expect them.
Forced tool use (``"required"`` or a named function) is planned with the JSON schema the
output is constrained to (``engine.server.tools.forced``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.server.errors import bad_request
from engine.server.tools.forced import (  # noqa: F401 - re-exported: the request's tool API
    ForcedToolCallParser,
    parse_forced_tool_calls,
    tool_choice_json_schema,
)
from engine.server.tools.parser import ToolCall, ToolParser

# OpenAI's rule for function names.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CHOICES = ("none", "auto", "required")


@dataclass
class ToolPlan:
    """How one chat request uses tools.

    ``template_tools``: the tool definitions passed to the chat template (None: none).
    ``parser``: reads tool calls from the output (None: the output is plain content).
    ``parallel_tool_calls``: False keeps only the first parsed call.
    ``json_schema``: forced tool use constrains the output to this schema (structured outputs).
    ``calls_finish_reason``: the choice's finish reason when calls were made: "tool_calls",
    except for a named function, which finishes with "stop" as OpenAI's API does.
    """

    template_tools: list[dict[str, Any]] | None = None
    parser: ToolParser | None = None
    parallel_tool_calls: bool = True
    json_schema: dict[str, Any] | None = None
    calls_finish_reason: str = "tool_calls"

    def limit(self, calls: list[ToolCall]) -> list[ToolCall]:
        """The calls to return (only the first when parallel calls are off)."""
        return calls if self.parallel_tool_calls else calls[:1]


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """Check the ``tools`` list; return it. 400 naming the entry that is wrong."""
    if not isinstance(tools, list) or not tools:
        raise bad_request("tools must be a non-empty list of function tools", "tools")
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object", where)
        if tool.get("type") != "function":
            raise bad_request(
                f"{where}.type must be 'function', got {tool.get('type')!r}", f"{where}.type"
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_request(
                f"{where}.function must be an object with a name", f"{where}.function"
            )
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(
                f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                f"{where}.function.name",
            )
        if name in seen:
            raise bad_request(
                f"{where}.function.name: duplicate tool name {name!r} (also tools.{seen[name]})",
                f"{where}.function.name",
            )
        seen[name] = i
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_request(
                f"{where}.function.description must be a string", f"{where}.function.description"
            )
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(
                f"{where}.function.parameters must be a JSON Schema object, "
                f"got {type(parameters).__name__}",
                f"{where}.function.parameters",
            )
    return tools


def normalize_tool_choice(tool_choice: Any, tools: list[dict[str, Any]] | None) -> str | dict:
    """``tool_choice`` checked against ``tools``: "none", "auto", "required" or
    ``{"type": "function", "function": {"name": ...}}``. Absent means "auto" when tools are
    given, else "none" (OpenAI's default)."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in _CHOICES:
            raise bad_request(
                f"tool_choice must be one of {', '.join(_CHOICES)} or "
                f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}',
                "tool_choice",
            )
    else:
        function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request(
                'a named tool_choice must be {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
    if tool_choice != "none" and not tools:
        raise bad_request("tool_choice is only allowed when tools are given", "tool_choice")
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        names = [t["function"]["name"] for t in tools or ()]
        if name not in names:
            raise bad_request(
                f"tool_choice names the function {name!r}, which is not in tools "
                f"({', '.join(names)})",
                "tool_choice.function.name",
            )
    return tool_choice


def plan_tool_use(
    tools: Any,
    tool_choice: Any,
    *,
    parser: ToolParser | None,
    parallel_tool_calls: bool = True,
    exclude_tools_when_tool_choice_none: bool = False,
) -> ToolPlan:
    """Validate a request's tool fields and decide what the template sees and what is parsed.

    ``parser`` is the server's (``--enable-auto-tool-choice --tool-call-parser NAME``) or None.
    """
    if tools is not None:
        tools = validate_tools(tools)
    choice = normalize_tool_choice(tool_choice, tools)
    if choice == "none":
        keep = tools is not None and not exclude_tools_when_tool_choice_none
        return ToolPlan(template_tools=tools if keep else None)
    if choice == "auto":
        if parser is None:
            raise bad_request(
                '"auto" tool choice requires the server to be started with '
                "--enable-auto-tool-choice and --tool-call-parser (or send "
                'tool_choice: "none" to only show the tools to the model)',
                "tool_choice",
            )
        return ToolPlan(
            template_tools=tools,
            parser=parser.for_tools(tools),
            parallel_tool_calls=parallel_tool_calls,
        )
    # "required" or a named function: guided decoding writes the calls, no parser flags needed.
    try:
        schema = tool_choice_json_schema(tools, choice)
    except ValueError as e:
        raise bad_request(f"cannot force tool use with these tools: {e}", "tools") from None
    if choice == "required" and not parallel_tool_calls:
        schema = {**schema, "maxItems": 1}
    return ToolPlan(
        template_tools=tools,
        parser=ForcedToolCallParser(choice),
        json_schema=schema,
        calls_finish_reason="tool_calls" if choice == "required" else "stop",
    )


# ---------------------------------------------------------------- conversation history


def prepare_tool_history(message: dict[str, Any], index: int) -> None:
    """Check and reshape the tool fields of one conversation message, in place.

    An assistant message's ``tool_calls`` carry ``function.arguments`` as a JSON text (the
    OpenAI wire format); Hugging Face chat templates iterate over them as a mapping, so they are
    decoded here. A ``tool`` message must say which call it answers (``tool_call_id``).
    """
    where = f"messages.{index}"
    calls = message.get("tool_calls")
    if calls is not None:
        if message.get("role") != "assistant":
            raise bad_request(f"{where}.tool_calls: only assistant messages have tool calls", where)
        if not isinstance(calls, list):
            raise bad_request(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        shaped = []
        for j, call in enumerate(calls):
            at = f"{where}.tool_calls.{j}"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise bad_request(
                    f'{at} must be {{"id", "type": "function", "function": {{"name", '
                    '"arguments"}}',
                    at,
                )
            arguments = function.get("arguments", "{}")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except ValueError as e:
                    raise bad_request(
                        f"{at}.function.arguments is not valid JSON: {e}",
                        f"{at}.function.arguments",
                    ) from None
            shaped.append({**call, "function": {**function, "arguments": arguments}})
        message["tool_calls"] = shaped
    if message.get("role") == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise bad_request(
            f"{where}: a tool message needs tool_call_id (the id of the call it answers)",
            f"{where}.tool_call_id",
        )
