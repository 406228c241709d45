"""Reading OpenAI's harmony format (GPT-OSS's output) into messages, piece by piece.

GPT-OSS writes every turn as messages whose markup is special tokens. Its chat template ends
the prompt with ``<|start|>assistant``, so a generation usually reads::

    <|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>
    <|start|>assistant<|channel|>final<|message|>The answer is 4.<|return|>

(without the line break) and a function call::

    <|channel|>analysis<|message|>Need weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"location": "Tokyo"}<|call|>

A message is a header (role, ``<|channel|>NAME``, a recipient ``to=functions.NAME`` after
the role or after the channel, a content type ``<|constrain|>json`` or ``json``) then
``<|message|>`` and the body, ended by ``<|end|>``, or by ``<|return|>`` / ``<|call|>``, which
end the turn (GPT-OSS's end-of-sequence ids, so the engine usually stops before they reach
the text). Channels: ``analysis`` is the chain of thought, ``commentary`` holds function
calls (with a recipient) or preambles to them (without one), ``final`` is the answer.

``HarmonyReader`` turns text, split anywhere, into ``HarmonyEvent``s (a message opens, body
text, the message closes), holding back what may be the start of a special token. It is
lenient, as a model may misbehave: text with no markup is one message without a channel; a
header may start without ``<|start|>`` (``<|channel|>...``, or ``to=...`` right at the
start of the output); a header cut off before ``<|message|>`` is dropped; a new header
(``<|start|>``, ``<|channel|>``) closes the message before it; stray tokens are dropped.
The reasoning parser ``openai_gptoss`` and the tool-call parser ``openai`` both read outputs
with it, so they agree on where every message begins and ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
RETURN = "<|return|>"
CALL = "<|call|>"
# The harmony tokens that end a message; RETURN and CALL also end the turn.
TERMINATORS = (END, RETURN, CALL)
# Special tokens of GPT-OSS's vocabulary that are no harmony markup but must not show either.
OTHER_SPECIAL = ("<|endoftext|>", "<|startoftext|>", "<|endofprompt|>")
MARKUP = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL, *OTHER_SPECIAL)
# What may open a header right at the start of the output: the prompt ended with
# "<|start|>assistant", so the model goes on with its channel or its recipient.
FIRST_OPENERS = (START, CHANNEL, CONSTRAIN, "to=", " to=")
FUNCTIONS = "functions."
_LONGEST = max(map(len, MARKUP))


@dataclass(frozen=True)
class Header:
    """What a message's header says (None: not said)."""

    channel: str | None = None
    recipient: str | None = None

    @property
    def function(self) -> str | None:
        """The function called, for a message addressed ``to=functions.NAME``."""
        if self.recipient is not None and self.recipient.startswith(FUNCTIONS):
            return self.recipient[len(FUNCTIONS) :] or None
        return None

    @property
    def kind(self) -> Literal["call", "reasoning", "content"]:
        """How the chat API shows the message: a function call, reasoning (the analysis
        channel, built-in tool calls on it included), or content (final, commentary preambles,
        no channel at all, and calls to recipients that are not functions)."""
        if self.function is not None:
            return "call"
        return "reasoning" if self.channel == "analysis" else "content"

    def render(self) -> str:
        """The header as harmony markup, from ``<|start|>`` to ``<|message|>`` inclusive."""
        channel = f"{CHANNEL}{self.channel}" if self.channel else ""
        recipient = f" to={self.recipient}" if self.recipient else ""
        return f"{START}assistant{channel}{recipient}{MESSAGE}"


def parse_header(text: str) -> Header:
    """The ``Header`` of the header text between ``<|start|>`` (or the start of the output)
    and ``<|message|>``, e.g. ``assistant<|channel|>commentary to=functions.f <|constrain|>json``
    or `` to=functions.f<|channel|>commentary json``."""
    words = text.replace(CHANNEL, f" {CHANNEL} ").replace(CONSTRAIN, f" {CONSTRAIN} ").split()
    channel = recipient = None
    for i, word in enumerate(words):
        if word == CHANNEL and channel is None and i + 1 < len(words):
            nxt = words[i + 1]
            if nxt not in (CHANNEL, CONSTRAIN) and not nxt.startswith("to="):
                channel = nxt
        elif word.startswith("to=") and recipient is None and len(word) > 3:
            recipient = word[3:]
    return Header(channel, recipient)


@dataclass(frozen=True)
class HarmonyEvent:
    """One step of an output: a message ``open``s (with its ``header``), its body ``text``
    comes, it ``close``s (``text``: the token that ended it, "" when cut off or interrupted
    by the next header, or at the end of the output)."""

    kind: Literal["open", "text", "close"]
    header: Header | None = None
    text: str = ""


def find_markup(text: str, start: int = 0) -> tuple[int, str]:
    """``(index, token)`` of the first harmony or special token in ``text`` from ``start``;
    ``(-1, "")`` when there is none."""
    i = text.find("<|", start)
    while i >= 0:
        for token in MARKUP:
            if text.startswith(token, i):
                return i, token
        i = text.find("<|", i + 2)
    return -1, ""


def partial_markup_length(text: str) -> int:
    """Length of the longest end of ``text`` that begins a special token: the characters to
    hold back, since the next piece may complete the token."""
    for n in range(min(len(text), _LONGEST - 1), 0, -1):
        tail = text[-n:]
        if any(token.startswith(tail) for token in MARKUP):
            return n
    return 0


class HarmonyReader:
    """Reads one output into ``HarmonyEvent``s, fed piece by piece; the events (joined text)
    do not depend on where the output was split."""

    __slots__ = ("state", "at_start", "pending", "header_text")

    def __init__(self) -> None:
        self.state: Literal["between", "header", "body"] = "between"
        self.at_start = True  # nothing read yet: a header may open with "to=" here
        self.pending = ""  # held back: may be the beginning of a token
        self.header_text = ""  # the header read so far

    def feed(self, text: str, finished: bool = False) -> list[HarmonyEvent]:
        """The events ``text`` completes; with ``finished`` (the end of the output) nothing
        is held back and an open message closes."""
        buf, self.pending = self.pending + text, ""
        events: list[HarmonyEvent] = []
        while buf:
            if self.state == "between":
                buf = self._between(buf, finished, events)
            elif self.state == "header":
                buf = self._header(buf, finished, events)
            else:
                buf = self._body(buf, finished, events)
        if finished:
            if self.state == "body":
                events.append(HarmonyEvent("close"))
            # A header cut off before <|message|> opened no message: nothing to show.
            self.state, self.header_text, self.pending = "between", "", ""
        return events

    def _between(self, buf: str, finished: bool, events: list[HarmonyEvent]) -> str:
        """Before a message: a header, stray tokens to drop, or text with no header."""
        i, token = find_markup(buf)
        if i == 0:
            self.at_start = False
            if token in (START, CHANNEL, CONSTRAIN):
                self.state = "header"
                self.header_text = "" if token == START else token
            elif token == MESSAGE:  # an empty header
                events.append(HarmonyEvent("open", Header()))
                self.state = "body"
            return buf[len(token) :]  # anything else: a stray token, dropped
        openers = FIRST_OPENERS if self.at_start else (START, CHANNEL, CONSTRAIN)
        if self.at_start and buf.startswith(openers):
            self.state, self.at_start = "header", False
            return buf
        if not finished and any(o.startswith(buf) for o in (*openers, *MARKUP)):
            self.pending = buf  # too short to tell yet
            return ""
        # Text with no header: a message without a channel (content).
        self.at_start = False
        events.append(HarmonyEvent("open", Header()))
        self.state = "body"
        return buf

    def _header(self, buf: str, finished: bool, events: list[HarmonyEvent]) -> str:
        i, token = find_markup(buf)
        if i < 0:
            keep = 0 if finished else partial_markup_length(buf)
            self.header_text += buf[: len(buf) - keep]
            self.pending = buf[len(buf) - keep :]
            return ""
        self.header_text += buf[:i]
        rest = buf[i + len(token) :]
        if token == MESSAGE:
            events.append(HarmonyEvent("open", parse_header(self.header_text)))
            self.state, self.header_text = "body", ""
        elif token in (CHANNEL, CONSTRAIN):
            self.header_text += token
        elif token == START:  # a new header: the one before it said nothing
            self.header_text = ""
        else:  # a terminator or another special token: no message after all
            self.state, self.header_text = "between", ""
        return rest

    def _body(self, buf: str, finished: bool, events: list[HarmonyEvent]) -> str:
        i, token = find_markup(buf)
        if i < 0:
            keep = 0 if finished else partial_markup_length(buf)
            if len(buf) > keep:
                events.append(HarmonyEvent("text", text=buf[: len(buf) - keep]))
            self.pending = buf[len(buf) - keep :]
            return ""
        if i:
            events.append(HarmonyEvent("text", text=buf[:i]))
        rest = buf[i + len(token) :]
        if token in TERMINATORS:
            events.append(HarmonyEvent("close", text=token))
            self.state = "between"
        elif token in (START, CHANNEL):  # the next header, with no <|end|> before it
            events.append(HarmonyEvent("close"))
            self.state = "header"
            self.header_text = "" if token == START else token
        # <|message|>, <|constrain|> or another special token inside a body: dropped.
        return rest


class MessageJoiner:
    """Joins the bodies of the messages that go to one field (reasoning or content): each
    message after the first that said something starts on a new line."""

    __slots__ = ("has_text", "new_message")
    SEPARATOR = "\n"

    def __init__(self) -> None:
        self.has_text = False
        self.new_message = False

    def open(self) -> None:
        """A message of this field begins."""
        self.new_message = True

    def text(self, text: str) -> str:
        """``text`` of the current message, with the separator before a later message."""
        if not text:
            return ""
        sep = self.SEPARATOR if self.new_message and self.has_text else ""
        self.has_text, self.new_message = True, False
        return sep + text
