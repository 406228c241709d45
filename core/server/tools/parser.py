"""Tool-call parsers: the interface, the shared result types and the registry of parsers.

A parser turns the text a model generated into plain content and tool calls. It works on a
stream of text pieces (``ToolCallStream.feed`` / ``finish``) and the non-streaming result is
that same stream fed the whole text at once, so a streamed response and a non-streamed one
always agree, however the text was split into pieces.

Parsers are named: ``--tool-call-parser hermes`` picks a built-in one from ``TOOL_PARSERS``
(qualified class names, imported only when chosen), and ``--tool-call-parser pkg.mod:Class``
imports a parser that lives outside the engine. Adding a built-in parser is one module with a
``ToolParser`` subclass plus one line in ``TOOL_PARSERS``.
"""

from __future__ import annotations

import importlib
import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

# name -> "module:Class". Detection imports nothing; ``load_tool_parser`` imports the one chosen.
TOOL_PARSERS: dict[str, str] = {
    "hermes": "engine.server.tools.hermes:HermesToolParser",
    "llama3_json": "engine.server.tools.llama3_json:Llama3JsonToolParser",
    "mistral": "engine.server.tools.mistral:MistralToolParser",
    "openai": "engine.server.tools.openai:OpenAIToolParser",
    "pythonic": "engine.server.tools.pythonic:PythonicToolParser",
    "qwen3_coder": "engine.server.tools.qwen3_coder:Qwen3CoderToolParser",
}


class ToolParserNotFound(ValueError):
    """``--tool-call-parser`` names no known parser and no importable ``module:Class``."""


def tool_call_id() -> str:
    """A fresh tool-call id, like OpenAI's ``call_...``."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One parsed call: ``arguments`` is a JSON text (what the OpenAI API returns)."""

    name: str
    arguments: str
    id: str = field(default_factory=tool_call_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry (with ``index`` in stream deltas)."""
        out: dict[str, Any] = {} if index is None else {"index": index}
        out.update(
            {
                "id": self.id,
                "type": "function",
                "function": {"name": self.name, "arguments": self.arguments},
            }
        )
        return out


@dataclass
class StreamUpdate:
    """What one ``feed``/``finish`` produced: content that is safe to show, and whole calls."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


@dataclass
class ParsedToolOutput:
    """A whole generation, parsed: ``content`` is None when nothing but calls was generated."""

    content: str | None
    calls: list[ToolCall]


def call_from_object(obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """A ``ToolCall`` from a decoded ``{"name": ..., <argument key>: {...}}``, or None when the
    object does not have that shape (the caller then treats the text as content).

    Arguments may be an object or a JSON text holding one (some models write them as a string);
    missing arguments mean ``{}``.
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args: Any = {}
    for key in argument_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        try:
            decoded = json.loads(args)
        except ValueError:
            return None
        if not isinstance(decoded, dict):
            return None
        return ToolCall(name=name, arguments=args)
    if not isinstance(args, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def json_value_end(text: str, start: int) -> int:
    """Index just past the JSON object or array opening at ``text[start]`` (strings and
    escapes respected), or -1 when it is not closed yet: where a streamed call may end."""
    depth = 0
    in_string = False
    escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


def partial_marker_length(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker``: the
    characters to hold back because the next piece may complete the marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ContentBetweenCalls:
    """Stream mixin for formats whose calls may be surrounded by text: ``_outside`` shows the
    text between calls, but holds back a stretch that is whitespace only until real text
    follows, so the newlines around a call never become content of their own. Subclasses
    reset ``segment_has_text`` (and ``pending_ws``) when a call ends a stretch."""

    pending_ws: str = ""  # whitespace-only text outside calls, shown once text follows
    segment_has_text: bool = False  # the current stretch outside calls showed text already
    num_calls: int = 0  # calls made so far

    def _outside(self, text: str, out: StreamUpdate) -> None:
        if not text:
            return
        if self.segment_has_text:
            out.content += text
            return
        self.pending_ws += text
        if self.pending_ws.strip():
            out.content += self.pending_ws
            self.pending_ws = ""
            self.segment_has_text = True

    def _release_whitespace(self, out: StreamUpdate) -> None:
        """At the end: an answer with no call keeps the whitespace held back; around calls it
        is dropped."""
        if self.num_calls == 0:
            out.content += self.pending_ws
        self.pending_ws = ""


class ToolCallStream(ABC):
    """The parsing state of one generated choice.

    ``feed`` takes the next piece of text; ``finish`` is called once when the choice ends and
    releases whatever was held back (an unclosed call that still parses becomes a call, the
    rest becomes content). Implementations must give the same concatenated content and the same
    calls however the text is split into pieces.
    """

    @abstractmethod
    def feed(self, text: str) -> StreamUpdate:
        """Consume ``text``; return the content now safe to show and the calls now complete."""

    @abstractmethod
    def finish(self) -> StreamUpdate:
        """End of generation: return everything still held back."""


class ToolParser(ABC):
    """A model family's tool-call format. One instance serves every request (keep it stateless:
    per-choice state lives in the ``ToolCallStream`` that ``stream()`` returns)."""

    name: str = ""
    # The markers may be special tokens in some vocabularies (Hermes 2 Pro's <tool_call>):
    # then the output is detokenized with them unless the request set skip_special_tokens.
    needs_special_tokens: bool = False
    # The parser reads OpenAI's harmony messages (engine.server.harmony): the openai_gptoss
    # reasoning parser then leaves the calls, as harmony, in the content it hands on.
    reads_harmony: bool = False

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A new parsing state for one generated choice."""

    def for_tools(self, tools: list[dict[str, Any]] | None) -> ToolParser:
        """The parser for one request's ``tools`` (validated chat function tools): itself,
        unless the format needs the tools' schemas to read the calls (Qwen3-Coder writes
        argument values as bare text, typed by their schema)."""
        del tools
        return self

    def parse(self, text: str) -> ParsedToolOutput:
        """Parse a whole generation (the stream, fed everything at once)."""
        state = self.stream()
        first = state.feed(text)
        last = state.finish()
        content = first.content + last.content
        return ParsedToolOutput(content or None, first.calls + last.calls)


def load_tool_parser(name: str) -> ToolParser:
    """The parser called ``name`` (a key of ``TOOL_PARSERS``) or at ``module:Class``."""
    target = TOOL_PARSERS.get(name)
    if target is None:
        if ":" not in name:
            raise ToolParserNotFound(
                f"unknown tool call parser {name!r}; choose one of "
                f"{', '.join(sorted(TOOL_PARSERS))}, or give an importable 'module:Class'"
            )
        target = name
    module_name, _, class_name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ToolParserNotFound(f"cannot load tool call parser {target!r}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
        raise ToolParserNotFound(f"{target!r} is not a ToolParser subclass")
    return cls()


def tool_parser_from_flags(enable_auto_tool_choice: bool, tool_call_parser: str | None):
    """The server's parser from ``--enable-auto-tool-choice`` and ``--tool-call-parser``
    (None when tool calling is off); ``ConfigError`` when only one is given or the parser is
    unknown."""
    from engine.config import ConfigError

    if enable_auto_tool_choice and not tool_call_parser:
        raise ConfigError(
            "--enable-auto-tool-choice requires --tool-call-parser (one of "
            f"{', '.join(sorted(TOOL_PARSERS))}) to say how the model writes tool calls"
        )
    if tool_call_parser and not enable_auto_tool_choice:
        raise ConfigError(
            f"--tool-call-parser {tool_call_parser} requires --enable-auto-tool-choice "
            '(tool calls are parsed only for tool_choice "auto")'
        )
    if not tool_call_parser:
        return None
    try:
        return load_tool_parser(tool_call_parser)
    except ToolParserNotFound as e:
        raise ConfigError(f"--tool-call-parser: {e}") from None
