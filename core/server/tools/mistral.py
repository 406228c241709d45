"""The Mistral / Mixtral tool-call format.

Calls follow the ``[TOOL_CALLS]`` token, optionally after some text. Older tokenizers (up to
v0.3) write a JSON array of calls after it; newer ones (v11+) write each call as its name, the
``[ARGS]`` token and a JSON object, the whole repeated per call::

    Let me check.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens, so the output is detokenized with them (as
vLLM does); when a request skips special tokens the markers are gone and the text is content.
Text before ``[TOOL_CALLS]`` is content; whitespace around calls is dropped once a call was made.
When what follows a marker is not a well-formed call, the text from there on is content (the
marker included when that attempt made no call yet), so a malformed call is never lost. Each
call gets a 9-character alphanumeric id: Mistral chat templates require that format when the
conversation is sent back.
"""

from __future__ import annotations

import json
import random
import string

from engine.server.tools.parser import (
    ContentBetweenCalls,
    StreamUpdate,
    ToolCall,
    ToolCallStream,
    ToolParser,
    call_from_object,
    json_value_end,
    partial_marker_length,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"

_ID_ALPHABET = string.ascii_letters + string.digits
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-.")
_MAX_NAME = 64  # the longest tool name a request may declare

# OUTSIDE: content, looking for [TOOL_CALLS]. START: after it, before the first non-space.
# ARRAY: inside the v0.3 JSON array. HEADER: a v11 name before [ARGS]. ARGS: its JSON object.
# TEXT: a call was malformed, everything from there on is content.
_OUTSIDE, _START, _ARRAY, _HEADER, _ARGS, _TEXT = range(6)


def mistral_tool_call_id() -> str:
    """A tool-call id in the format Mistral templates accept: 9 letters or digits."""
    return "".join(random.choices(_ID_ALPHABET, k=9))


class _MistralStream(ContentBetweenCalls, ToolCallStream):
    def __init__(self) -> None:
        self.mode = _OUTSIDE
        self.buf = ""  # text not yet classified
        self.raw = ""  # this attempt's consumed text since its marker or its last call
        self.attempt_calls = 0  # calls made since the current [TOOL_CALLS]
        self.name = ""  # the v11 call whose arguments are being read
        self.pending_ws = ""  # whitespace-only text outside calls, shown once text follows
        self.segment_has_text = False  # the current stretch outside calls showed text already
        self.num_calls = 0

    def _consume(self, n: int) -> None:
        self.raw += self.buf[:n]
        self.buf = self.buf[n:]

    def _call(self, call: ToolCall, out: StreamUpdate) -> None:
        call.id = mistral_tool_call_id()
        out.calls.append(call)
        self.num_calls += 1
        self.attempt_calls += 1
        self.raw = ""
        self.pending_ws = ""  # whitespace around calls is not content

    def _give_up(self, out: StreamUpdate) -> None:
        """Not a call: the attempt's text (from the failing part on, once it made a call) and
        all that follows is content."""
        if self.attempt_calls == 0:
            rest = self.pending_ws + self.raw + self.buf
        else:
            rest = (self.raw + self.buf).lstrip(" \t\r\n,")
        self.pending_ws = self.raw = self.buf = ""
        out.content += rest
        self.mode = _TEXT

    def _close(self) -> None:
        """The attempt ended well: back to content, looking for another [TOOL_CALLS]."""
        self.raw = ""
        self.mode = _OUTSIDE
        self.segment_has_text = False

    def feed(self, text: str) -> StreamUpdate:
        out = StreamUpdate()
        if self.mode == _TEXT:
            out.content = text
            return out
        self.buf += text
        while self._step(out):
            pass
        return out

    def _step(self, out: StreamUpdate) -> bool:
        """Advance through ``buf`` once; False when more text is needed (or all is content)."""
        buf = self.buf
        if self.mode == _OUTSIDE:
            i = buf.find(TOOL_CALLS)
            if i < 0:
                cut = len(buf) - partial_marker_length(buf, TOOL_CALLS)
                self._outside(buf[:cut], out)
                self.buf = buf[cut:]
                return False
            self._outside(buf[:i], out)
            self.buf = buf[i:]
            self.raw, self.attempt_calls = "", 0
            self._consume(len(TOOL_CALLS))
            self.mode = _START
            return True
        if self.mode == _START:
            lead = len(buf) - len(buf.lstrip())
            if lead == len(buf):
                return False
            self._consume(lead)
            if self.buf[0] == "[":
                self._consume(1)
                self.mode = _ARRAY
            else:
                self.mode = _HEADER
            return True
        if self.mode == _ARRAY:
            i = 0
            while i < len(buf) and (buf[i].isspace() or buf[i] == ","):
                i += 1
            if i == len(buf):
                return False
            if buf[i] == "]":
                self._consume(i + 1)
                self._close()
                return True
            if buf[i] != "{":
                self._give_up(out)
                return False
            end = json_value_end(buf, i)
            if end < 0:
                return False
            try:
                obj = json.loads(buf[i:end])
            except ValueError:
                obj = None
            call = call_from_object(obj, ("arguments", "parameters"))
            if call is None:
                self._give_up(out)
                return False
            self._consume(end)
            self._call(call, out)
            return True
        if self.mode == _HEADER:
            i = buf.find(ARGS)
            head = buf[: len(buf) - partial_marker_length(buf, ARGS)] if i < 0 else buf[:i]
            if len(head) > _MAX_NAME or not set(head) <= _NAME_CHARS or (i == 0):
                self._give_up(out)
                return False
            if i < 0:
                return False
            self.name = head
            self._consume(i + len(ARGS))
            self.mode = _ARGS
            return True
        if self.mode == _ARGS:
            stripped = buf.lstrip()
            if not stripped:
                return False
            start = len(buf) - len(stripped)
            if stripped[0] != "{":
                self._give_up(out)
                return False
            end = json_value_end(buf, start)
            if end < 0:
                return False
            try:
                args = json.loads(buf[start:end])
            except ValueError:
                args = None
            if not isinstance(args, dict):
                self._give_up(out)
                return False
            self._consume(end)
            self._call(ToolCall(self.name, json.dumps(args, ensure_ascii=False)), out)
            self._close()
            return True
        return False  # _TEXT: the rest was handed out as content

    def finish(self) -> StreamUpdate:
        out = StreamUpdate()
        if self.mode == _OUTSIDE:
            self._outside(self.buf, out)
        elif self.mode == _ARRAY and self.attempt_calls and not self.buf.strip(" \t\r\n,"):
            pass  # an array cut before its "]" after complete calls: those calls stand
        elif self.mode != _TEXT:
            self._give_up(out)
        self.buf = ""
        self._release_whitespace(out)
        return out


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` (Mistral v0.3) or
    ``[TOOL_CALLS]name[ARGS]{...}`` (v11+ tokenizers: Mistral Small 3.1+, Devstral, ...)."""

    name = "mistral"
    needs_special_tokens = True

    def stream(self) -> ToolCallStream:
        return _MistralStream()
