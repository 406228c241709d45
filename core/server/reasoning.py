"""Reasoning parsers (vLLM's ``--reasoning-parser``): a reasoning model's thinking goes to the
chat response's ``reasoning`` field (and to ``reasoning_content``, its older name, which
DeepSeek's API and many clients read) instead of ``content``; the rest is the content (and
what a tool-call parser reads).

Models that think between ``<think>`` and ``</think>`` (the text after ``</think>`` is the
content):

* ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ, Qwen3 "Thinking" models): the output is
  reasoning from its first token, whether or not it repeats the ``<think>`` its chat template
  already opened, until ``</think>``; without one, all of it is reasoning.
* ``qwen3`` (hybrid Qwen3 models): the output is reasoning only when it opens with
  ``<think>`` (thinking on); otherwise (``enable_thinking: false`` in
  ``chat_template_kwargs``, whose template closes the think block in the prompt) it is all
  content. Models whose template opens the block itself (Qwen3 "Thinking-2507") write no
  ``<think>``: serve them with ``deepseek_r1``.

And GPT-OSS, which writes OpenAI's harmony format (``engine.server.harmony``):

* ``openai_gptoss``: the ``analysis`` channel is the reasoning; the ``final`` channel and
  ``commentary`` without a recipient (preambles) are the content; the markup (special tokens,
  so the output is detokenized with them: ``needs_special_tokens``) never shows. Function
  calls (``to=functions.NAME``) are left, as harmony, to the ``openai`` tool-call parser when
  the request's calls are parsed by it; otherwise their bodies are content, as in vLLM.

A parser's ``stream()`` splits a streamed output delta by delta, holding back the few
characters that may be the start of a tag split across deltas; ``split`` is the same on a
whole text, so a streamed response and a plain one say the same.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from engine.server.harmony import HarmonyReader, MessageJoiner

if TYPE_CHECKING:
    from engine.server.tools.parser import ToolParser

START, END = "<think>", "</think>"


class ReasoningStream(ABC):
    """One choice's output, split delta by delta into reasoning and content."""

    __slots__ = ()

    @abstractmethod
    def step(self, text: str, finished: bool) -> tuple[str, str]:
        """The reasoning and the content in ``text`` (and in what was held back before it);
        with ``finished``, nothing is held back."""


class ReasoningParser(ABC):
    """How one family of models marks its reasoning (see the module docstring). One instance
    serves every request: per-choice state lives in the ``ReasoningStream`` of ``stream()``."""

    name: str  # what --reasoning-parser calls it
    # The markup is special tokens: the output must be detokenized with them (the chat path
    # turns skip_special_tokens off unless the request set it).
    needs_special_tokens: bool = False

    def split(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole output; None where there is none."""
        reasoning, content = self.stream().step(text, finished=True)
        return reasoning or None, content or None

    @abstractmethod
    def stream(self) -> ReasoningStream:
        """A new split for one generated choice."""

    def for_tool_parser(self, tool_parser: ToolParser | None) -> ReasoningParser:
        """The parser for a request whose content goes on to ``tool_parser`` (None: calls are
        not parsed): itself, unless the format's calls are markup that only the tool parser
        can read (harmony's)."""
        del tool_parser
        return self


@dataclass(frozen=True)
class ThinkTagParser(ReasoningParser):
    """Reasoning between ``<think>`` and ``</think>``."""

    name: str
    # Whether an output that does not open with START is reasoning until END (deepseek_r1)
    # or content (qwen3, unless END shows up in the whole text).
    reasons_from_start: bool

    def stream(self) -> ReasoningStream:
        return ThinkTagStream(self)


class ThinkTagStream(ReasoningStream):
    """The think-tag split of one choice."""

    __slots__ = ("parser", "mode", "pending")

    def __init__(self, parser: ThinkTagParser) -> None:
        self.parser = parser
        self.mode = "start"  # start -> reasoning -> content, or start -> content
        self.pending = ""  # held back: may be the beginning of a tag

    def step(self, text: str, finished: bool) -> tuple[str, str]:
        buf, self.pending = self.pending + text, ""
        reasoning, content = [], []
        while buf:
            if self.mode == "start":
                if buf.startswith(START):
                    buf, self.mode = buf[len(START) :], "reasoning"
                elif START.startswith(buf) and not finished:
                    self.pending, buf = buf, ""  # maybe "<thi..." of the opening tag
                else:
                    self.mode = "reasoning" if self.parser.reasons_from_start else "content"
            elif self.mode == "reasoning":
                end = buf.find(END)
                if end >= 0:
                    reasoning.append(buf[:end])
                    buf, self.mode = buf[end + len(END) :], "content"
                    continue
                keep = 0 if finished else _partial_tag(buf, END)
                reasoning.append(buf[: len(buf) - keep])
                self.pending, buf = buf[len(buf) - keep :], ""
            else:
                content.append(buf)
                buf = ""
        return "".join(reasoning), "".join(content)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (0: none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass(frozen=True)
class HarmonyReasoningParser(ReasoningParser):
    """GPT-OSS's harmony output: analysis messages are the reasoning, the other messages the
    content, the markup dropped. With ``keep_calls`` (the ``openai`` tool-call parser reads
    the content), the content side stays harmony, function calls included, for it to read;
    otherwise a call's body is content."""

    name: ClassVar[str] = "openai_gptoss"
    needs_special_tokens: ClassVar[bool] = True
    keep_calls: bool = False

    def stream(self) -> ReasoningStream:
        return HarmonyReasoningStream(self.keep_calls)

    def for_tool_parser(self, tool_parser: ToolParser | None) -> ReasoningParser:
        keep = tool_parser is not None and tool_parser.reads_harmony
        return self if keep == self.keep_calls else HarmonyReasoningParser(keep_calls=keep)


class HarmonyReasoningStream(ReasoningStream):
    """The harmony split of one choice (``HarmonyReasoningParser``)."""

    __slots__ = ("reader", "keep_calls", "route", "reasoning", "content")

    def __init__(self, keep_calls: bool) -> None:
        self.reader = HarmonyReader()
        self.keep_calls = keep_calls
        self.route = "content"  # where the open message's body goes
        self.reasoning = MessageJoiner()
        self.content = MessageJoiner()

    def step(self, text: str, finished: bool) -> tuple[str, str]:
        reasoning, content = [], []
        for event in self.reader.feed(text, finished):
            if event.kind == "open":
                assert event.header is not None
                kind = event.header.kind
                if kind == "reasoning":
                    self.route = "reasoning"
                    self.reasoning.open()
                elif self.keep_calls:
                    # The tool parser reads the messages as harmony (and joins the content).
                    self.route = "markup"
                    content.append(event.header.render())
                else:
                    self.route = "content"
                    self.content.open()
            elif event.kind == "text":
                if self.route == "reasoning":
                    reasoning.append(self.reasoning.text(event.text))
                elif self.route == "markup":
                    content.append(event.text)
                else:
                    content.append(self.content.text(event.text))
            elif self.route == "markup":
                # The token that ended the message ("" when none did: the next header or the
                # end of the output tells the tool parser as much).
                content.append(event.text)
        return "".join(reasoning), "".join(content)


REASONING_PARSERS: dict[str, ReasoningParser] = {
    p.name: p
    for p in (
        ThinkTagParser("deepseek_r1", reasons_from_start=True),
        ThinkTagParser("qwen3", reasons_from_start=False),
        HarmonyReasoningParser(),
    )
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered as ``name``; ValueError naming the choices otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}"
        ) from None
