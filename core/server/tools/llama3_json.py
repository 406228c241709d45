"""The Llama 3.x JSON tool-call format.

A generation that calls tools is one or more JSON objects, separated by ``;``, optionally
after the ``<|python_tag|>`` token (it is a special token: it only appears in the text when
``skip_special_tokens`` is false)::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

A generation that starts with anything else is plain content. When an object does not parse
or has no ``name``, the text from there on is content (with the leading tag too, when no call
was made before), so a model that answered with plain JSON keeps its answer.
"""

from __future__ import annotations

import json

from engine.server.tools.parser import (
    StreamUpdate,
    ToolCallStream,
    ToolParser,
    call_from_object,
    json_value_end,
)

PYTHON_TAG = "<|python_tag|>"

_UNDECIDED, _CALLS, _TEXT = range(3)


def _skip_separators(text: str) -> int:
    """Index of the first character of ``text`` that is neither whitespace nor ``;``."""
    i = 0
    while i < len(text) and (text[i].isspace() or text[i] == ";"):
        i += 1
    return i


class _Llama3JsonStream(ToolCallStream):
    def __init__(self) -> None:
        self.mode = _UNDECIDED
        self.buf = ""
        self.prefix = ""  # leading whitespace and the tag: content if no call is ever made
        self.num_calls = 0

    def _to_text(self, rest: str, out: StreamUpdate) -> None:
        """Give up on calls: ``rest`` (and the prefix, if nothing was called) is content."""
        out.content += (self.prefix if self.num_calls == 0 else "") + rest
        self.prefix = ""
        self.mode = _TEXT

    def _give_up(self, start: int, out: StreamUpdate) -> None:
        """Content from ``buf[start]`` on (the separators before it too, if no call was made)."""
        rest = self.buf if self.num_calls == 0 else self.buf[start:]
        self.buf = ""
        self._to_text(rest, out)

    def feed(self, text: str) -> StreamUpdate:
        out = StreamUpdate()
        if self.mode == _TEXT:
            out.content = text
            return out
        self.buf += text
        if self.mode == _UNDECIDED:
            head = self.buf.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return out  # only whitespace or part of the tag so far
            lead = len(self.buf) - len(head)
            if head.startswith(PYTHON_TAG):
                lead += len(PYTHON_TAG)
            elif not head.startswith("{"):
                self.buf, rest = "", self.buf
                self._to_text(rest, out)
                return out
            self.prefix, self.buf = self.buf[:lead], self.buf[lead:]
            self.mode = _CALLS
        self._scan(out)
        return out

    def _scan(self, out: StreamUpdate) -> None:
        """Emit every complete object at the front of ``buf``."""
        while self.mode == _CALLS:
            i = _skip_separators(self.buf)
            if i == len(self.buf):
                return  # separators only: wait for more
            if self.buf[i] != "{":
                self._give_up(i, out)
                return
            end = json_value_end(self.buf, i)
            if end < 0:
                return
            try:
                obj = json.loads(self.buf[i:end])
            except ValueError:
                obj = None
            call = call_from_object(obj, ("parameters", "arguments"))
            if call is None:
                self._give_up(i, out)
                return
            self.num_calls += 1
            self.prefix = ""
            out.calls.append(call)
            self.buf = self.buf[end:]

    def finish(self) -> StreamUpdate:
        out = StreamUpdate()
        if self.mode == _UNDECIDED:
            out.content = self.buf
        elif self.mode == _CALLS:
            i = _skip_separators(self.buf)
            if i < len(self.buf):  # an unfinished object
                self._give_up(i, out)
            elif self.num_calls == 0:
                out.content = self.prefix + self.buf
        self.buf = ""
        return out


class Llama3JsonToolParser(ToolParser):
    """``{"name": ..., "parameters": {...}}`` objects joined by ``;`` (Llama 3.1/3.2/3.3)."""

    name = "llama3_json"

    def stream(self) -> ToolCallStream:
        return _Llama3JsonStream()
