"""Reasoning parsers (vLLM's ``--reasoning-parser``): a reasoning model's thinking, written
between ``<think>`` and ``</think>``, goes to the chat response's ``reasoning`` field (and to
``reasoning_content``, its older name, which DeepSeek's API and many clients read) instead of
``content``; the text after ``</think>`` is the content (and what a tool-call parser reads).

* ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ, Qwen3 "Thinking" models): the output is
  reasoning from its first token, whether or not it repeats the ``<think>`` its chat template
  already opened, until ``</think>``; without one, all of it is reasoning.
* ``qwen3`` (hybrid Qwen3 models): the output is reasoning only when it opens with
  ``<think>`` (thinking on); otherwise (``enable_thinking: false`` in
  ``chat_template_kwargs``, whose template closes the think block in the prompt) it is all
  content. Models whose template opens the block itself (Qwen3 "Thinking-2507") write no
  ``<think>``: serve them with ``deepseek_r1``.

``ReasoningStream`` splits a streamed output delta by delta, holding back the few characters
that may be the start of a tag split across deltas; ``split`` is the same on a whole text, so
a streamed response and a plain one say the same.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """How one family of models marks its reasoning (see the module docstring)."""

    name: str
    # Whether an output that does not open with START is reasoning until END (deepseek_r1)
    # or content (qwen3, unless END shows up in the whole text).
    reasons_from_start: bool

    def split(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole output; None where there is none."""
        stream = self.stream()
        reasoning, content = stream.step(text, finished=True)
        return reasoning or None, content or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """One choice's output, split delta by delta into reasoning and content."""

    __slots__ = ("parser", "mode", "pending")

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.mode = "start"  # start -> reasoning -> content, or start -> content
        self.pending = ""  # held back: may be the beginning of a tag

    def step(self, text: str, finished: bool) -> tuple[str, str]:
        """The reasoning and the content in ``text`` (and in what was held back before it);
        with ``finished``, nothing is held back."""
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


REASONING_PARSERS: dict[str, ReasoningParser] = {
    p.name: p
    for p in (
        ReasoningParser("deepseek_r1", reasons_from_start=True),
        ReasoningParser("qwen3", reasons_from_start=False),
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
