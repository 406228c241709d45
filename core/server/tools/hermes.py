"""The Hermes / Qwen tool-call format.

Calls are JSON objects wrapped in tags, optionally after some text::

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "CET"}}
    </tool_call>

Text outside the tags is content, except that whitespace-only stretches between or around
calls are dropped once a call was made. A block whose JSON does not parse (or has no
``name``) is returned verbatim as content, tags included; an unclosed block at the end of the
generation (cut by ``max_tokens`` or a stop token) is a call if its JSON is complete.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from engine.server.tools.parser import (
    ContentBetweenCalls,
    StreamUpdate,
    ToolCall,
    ToolCallStream,
    ToolParser,
    call_from_object,
    partial_marker_length,
)

START = "<tool_call>"
END = "</tool_call>"


def _call_from_block(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return call_from_object(obj, ("arguments", "parameters"))


class TaggedBlockStream(ContentBetweenCalls, ToolCallStream):
    """Calls in ``<tool_call>...</tool_call>`` blocks, each block's body read by
    ``parse_block`` (None: not a call, so the block is content); the Hermes JSON body by
    default. Shared with formats that use the same tags around another body (Qwen3-Coder)."""

    def __init__(self, parse_block: Callable[[str], ToolCall | None] | None = None) -> None:
        self.parse_block = parse_block or _call_from_block
        self.buf = ""  # text not yet classified (a partial tag, or an open block's body)
        self.in_call = False
        self.pending_ws = ""  # whitespace-only text outside calls, shown once text follows
        self.segment_has_text = False  # the current stretch outside calls showed text already
        self.num_calls = 0

    def _block(self, body: str, closed: bool, out: StreamUpdate) -> None:
        call = self.parse_block(body)
        if call is not None:
            self.pending_ws = ""  # whitespace around calls is not content
            self.num_calls += 1
            out.calls.append(call)
            self.segment_has_text = False
            return
        raw = START + body + (END if closed else "")
        out.content += self.pending_ws + raw
        self.pending_ws = ""
        self.segment_has_text = True

    def feed(self, text: str) -> StreamUpdate:
        out = StreamUpdate()
        self.buf += text
        while True:
            if not self.in_call:
                i = self.buf.find(START)
                if i < 0:
                    keep = partial_marker_length(self.buf, START)
                    cut = len(self.buf) - keep
                    self._outside(self.buf[:cut], out)
                    self.buf = self.buf[cut:]
                    return out
                self._outside(self.buf[:i], out)
                self.buf = self.buf[i + len(START) :]
                self.in_call = True
                self.segment_has_text = False
            else:
                j = self.buf.find(END)
                if j < 0:
                    return out
                body = self.buf[:j]
                self.buf = self.buf[j + len(END) :]
                self.in_call = False
                self._block(body, True, out)

    def finish(self) -> StreamUpdate:
        out = StreamUpdate()
        if self.in_call:
            self._block(self.buf, False, out)
        else:
            self._outside(self.buf, out)
        self.buf = ""
        self._release_whitespace(out)
        return out


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes 2/3, Qwen 2.5/3)."""

    name = "hermes"
    needs_special_tokens = True

    def stream(self) -> ToolCallStream:
        return TaggedBlockStream()
