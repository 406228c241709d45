"""Tool calls in a chat choice's output: the whole message, or its stream deltas.

``parse_choice`` splits a finished output into content and ``tool_calls``. In a stream,
content that may still turn out to be part of a call is held back by the parser (no
``<tool_call>`` ever reaches ``delta.content``); each call goes out as soon as it is complete,
as two deltas the OpenAI clients accumulate::

    {"tool_calls": [{"index": 0, "id": "call_...", "type": "function",
                     "function": {"name": "get_weather", "arguments": ""}}]}
    {"tool_calls": [{"index": 0, "function": {"arguments": "{\\"city\\": \\"Paris\\"}"}}]}
"""

from __future__ import annotations

from typing import Any

from engine.server.tools.parser import StreamUpdate, ToolCall, ToolCallStream
from engine.server.tools.request import ToolPlan


def parse_choice(
    plan: ToolPlan, text: str, finish_reason: str | None
) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """``(content, tool_calls, finish_reason)`` of a finished choice: with a parser, calls are
    taken out of the text and the choice finishes with ``plan.calls_finish_reason`` when there
    are any;
    without one the text is all content."""
    if plan.parser is None:
        return text, [], finish_reason
    parsed = plan.parser.parse(text)
    calls = plan.limit(parsed.calls)
    if not calls:
        return parsed.content or "", [], finish_reason
    return parsed.content, [c.to_openai() for c in calls], plan.calls_finish_reason


def feed_stream(stream: ToolCallStream | None, text: str, finished: bool) -> StreamUpdate:
    """What a tool parser's ``stream`` releases for the next ``text`` of an output (``None``:
    no parser, all of it is content); ``finished`` releases what it held back."""
    if stream is None:
        return StreamUpdate(text)
    update = stream.feed(text) if text else StreamUpdate()
    if finished:
        last = stream.finish()
        update.content += last.content
        update.calls.extend(last.calls)
    return update


class ToolCallDeltas:
    """Turns the text deltas of one choice into chat ``delta`` objects (content, tool calls)."""

    def __init__(self, plan: ToolPlan) -> None:
        assert plan.parser is not None
        self._stream = plan.parser.stream()
        self._max_calls = None if plan.parallel_tool_calls else 1
        self.calls_finish_reason = plan.calls_finish_reason
        self.num_calls = 0

    @property
    def called(self) -> bool:
        """Whether a call was sent: the choice then finishes with ``calls_finish_reason``."""
        return self.num_calls > 0

    def step(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The deltas to send for ``text``; ``finished`` releases what was held back."""
        update = feed_stream(self._stream, text, finished)
        deltas: list[dict[str, Any]] = []
        if update.content:
            deltas.append({"content": update.content})
        for call in update.calls:
            if self._max_calls is not None and self.num_calls >= self._max_calls:
                break
            deltas.extend(self._call_deltas(call, self.num_calls))
            self.num_calls += 1
        return deltas

    @staticmethod
    def _call_deltas(call: ToolCall, index: int) -> list[dict[str, Any]]:
        head = call.to_openai(index)
        head["function"]["arguments"] = ""
        return [
            {"tool_calls": [head]},
            {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]},
        ]
