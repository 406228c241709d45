"""GPT-OSS's tool calls, in OpenAI's harmony format (vLLM's ``openai`` parser).

A call is a message addressed to the function, on the ``commentary`` channel, whose body is
the arguments' JSON; the recipient stands after the channel or after the role, and the
content type may be ``<|constrain|>json`` or a bare ``json``::

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"Tokyo"}<|call|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{...}<|call|>

Every message addressed ``to=functions.NAME`` is a call of ``NAME`` with the body, stripped,
as its arguments (``{}`` when empty); one cut off before ``<|call|>`` (``max_tokens``) is a
call only if its body is whole JSON, otherwise the body is content. ``final`` messages,
``commentary`` without a recipient (preambles) and text with no markup are the content, one
message per line; ``analysis`` messages are reasoning, which is not content (serve with
``--reasoning-parser openai_gptoss`` to return it). The markup is special tokens, so the
output is detokenized with them.
"""

from __future__ import annotations

import json

from engine.server.harmony import CALL, HarmonyReader, Header, MessageJoiner
from engine.server.tools.parser import StreamUpdate, ToolCall, ToolCallStream, ToolParser


class HarmonyToolCallStream(ToolCallStream):
    """The calls and content of one choice's harmony messages."""

    def __init__(self) -> None:
        self.reader = HarmonyReader()
        self.content = MessageJoiner()
        self.header: Header | None = None  # of the open message
        self.body = ""  # the open call's arguments so far

    def feed(self, text: str) -> StreamUpdate:
        return self._read(text, finished=False)

    def finish(self) -> StreamUpdate:
        return self._read("", finished=True)

    def _read(self, text: str, finished: bool) -> StreamUpdate:
        out = StreamUpdate()
        for event in self.reader.feed(text, finished):
            if event.kind == "open":
                self.header, self.body = event.header, ""
                if event.header is not None and event.header.kind == "content":
                    self.content.open()
            elif self.header is None:
                continue
            elif event.kind == "text":
                kind = self.header.kind
                if kind == "call":
                    self.body += event.text
                elif kind == "content":
                    out.content += self.content.text(event.text)
            else:  # close
                if self.header.kind == "call":
                    self._close_call(self.header, event.text == CALL, out)
                self.header, self.body = None, ""
        return out

    def _close_call(self, header: Header, called: bool, out: StreamUpdate) -> None:
        """The open call is over: ``called`` when ``<|call|>`` ended it (the engine usually
        stops before that token, as it is an end-of-sequence id: then the end of the output
        or the next message ends it, and its body must be whole JSON to count)."""
        assert header.function is not None
        args = self.body.strip()
        if not called and args and not _is_json(args):
            self.content.open()
            out.content += self.content.text(self.body)  # cut off: what it said is content
            return
        out.calls.append(ToolCall(name=header.function, arguments=args or "{}"))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class OpenAIToolParser(ToolParser):
    """Harmony function calls (GPT-OSS): messages addressed ``to=functions.NAME``."""

    name = "openai"
    needs_special_tokens = True
    reads_harmony = True

    def stream(self) -> ToolCallStream:
        return HarmonyToolCallStream()
