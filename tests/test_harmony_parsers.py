"""GPT-OSS's harmony output through the ``openai_gptoss`` reasoning parser and the ``openai``
tool-call parser, alone and chained as the chat path chains them (the tool parser reads the
content the reasoning parser hands on): whole outputs, and the same outputs cut at every
position (special tokens split across deltas) giving the same reasoning, content and calls,
with no harmony markup in any of them."""

from __future__ import annotations

import json

import pytest

from engine.server.harmony import HarmonyReader, parse_header
from engine.server.reasoning import HarmonyReasoningParser, get_reasoning_parser
from engine.server.tools.parser import load_tool_parser

REASONING = get_reasoning_parser("openai_gptoss")
TOOLS = load_tool_parser("openai")

ANALYSIS = "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>The answer is 4.<|return|>"
WEATHER = '{"location":"Tokyo"}'


def call(name: str, args: str) -> tuple[str, str]:
    return name, args


# text: (reasoning, content with the openai tool parser, calls, content without it)
CASES: dict[str, tuple[str | None, str | None, list[tuple[str, str]], str | None]] = {
    # The usual answer: analysis, then final.
    ANALYSIS + FINAL: ("User asks 2+2. Easy.", "The answer is 4.", [], "The answer is 4."),
    # A call after the analysis, recipient after the channel, <|constrain|>json.
    "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
    "to=functions.get_weather <|constrain|>json<|message|>" + WEATHER + "<|call|>": (
        "Need weather.",
        None,
        [call("get_weather", WEATHER)],
        WEATHER,
    ),
    # The recipient after the role, the content type a bare "json".
    "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant "
    "to=functions.get_weather<|channel|>commentary json<|message|>" + WEATHER + "<|call|>": (
        "Need weather.",
        None,
        [call("get_weather", WEATHER)],
        WEATHER,
    ),
    # A call right away: the prompt's "<|start|>assistant" goes on with the recipient.
    " to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
    + WEATHER
    + "<|call|>": (None, None, [call("get_weather", WEATHER)], WEATHER),
    # A preamble (commentary, no recipient) is content; two calls in a row.
    "<|channel|>analysis<|message|>Two cities.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather<|constrain|>json"
    '<|message|>{"location": "Paris"}<|call|>'
    "<|start|>assistant<|channel|>commentary to=functions.get_time<|message|>"
    ' {"tz": "CET"}\n<|call|>': (
        "Two cities.",
        "Checking both.",
        [call("get_weather", '{"location": "Paris"}'), call("get_time", '{"tz": "CET"}')],
        'Checking both.\n{"location": "Paris"}\n {"tz": "CET"}\n',
    ),
    # Several analysis messages: one per line; the generation opens with <|start|>.
    "<|start|>assistant<|channel|>analysis<|message|>First.<|end|>"
    "<|start|>assistant<|channel|>analysis<|message|>Second.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Done.<|return|>": (
        "First.\nSecond.",
        "Done.",
        [],
        "Done.",
    ),
    # No markup at all (a misbehaving model, or special tokens skipped): all content.
    "Just text, 1 < 2.": (None, "Just text, 1 < 2.", [], "Just text, 1 < 2."),
    "to be or not": (None, "to be or not", [], "to be or not"),
    # A message with no channel, and text that only looks like a token.
    "<|start|>assistant<|message|>a <|b|> c <| d": (
        None,
        "a <|b|> c <| d",
        [],
        "a <|b|> c <| d",
    ),
    # Cut off (max_tokens) while reasoning, in a header, in a call's arguments.
    "<|channel|>analysis<|message|>Still thinking": ("Still thinking", None, [], None),
    ANALYSIS + "<|start|>assistant<|channel|>fin": ("User asks 2+2. Easy.", None, [], None),
    ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.get_weather"
    '<|message|>{"location": "To': (
        "User asks 2+2. Easy.",
        '{"location": "To',
        [],
        '{"location": "To',
    ),
    # A call the output ends in without <|call|> is a call when its JSON is whole; an empty
    # body is no arguments.
    "<|channel|>commentary to=functions.now<|message|>": (None, None, [call("now", "{}")], None),
    '<|channel|>commentary to=functions.f<|message|>{"a": 1}': (
        None,
        None,
        [call("f", '{"a": 1}')],
        '{"a": 1}',
    ),
    # Stray and foreign special tokens are dropped; a built-in tool on the analysis channel
    # is reasoning.
    "<|end|><|channel|>analysis to=python code<|message|>print(1)<|call|>"
    "<|start|>assistant<|channel|>final<|message|>Hi<|constrain|>!<|endoftext|>": (
        "print(1)",
        "Hi!",
        [],
        "Hi!",
    ),
    "": (None, None, [], None),
}

ALLOWED_MARKUP = "<|b|>"  # not a harmony token: text


def _no_markup(*texts: str | None) -> None:
    for text in texts:
        if text:
            assert "<|" not in text.replace(ALLOWED_MARKUP, "").replace("<| d", ""), text


def _pieces(text: str):
    """Every split of ``text``: into two at each position, and into pieces of each size."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    for size in range(1, min(len(text), 24)):
        yield [text[i : i + size] for i in range(0, len(text), size)]


def _reasoning_stream(parser, pieces):
    stream = parser.stream()
    reasoning = content = ""
    for k, piece in enumerate(pieces):
        r, c = stream.step(piece, finished=k == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning or None, content or None


def _tools_stream(pieces):
    stream = TOOLS.stream()
    content, calls = "", []
    for piece in pieces:
        update = stream.feed(piece)
        content += update.content
        calls += update.calls
    last = stream.finish()
    return content + last.content or None, calls + last.calls


def _chained_stream(pieces):
    """As the chat route streams: each delta split, its content fed to the tool parser."""
    thinking = REASONING.for_tool_parser(TOOLS).stream()
    stream = TOOLS.stream()
    reasoning = content = ""
    calls = []
    for k, piece in enumerate(pieces):
        finished = k == len(pieces) - 1
        r, text = thinking.step(piece, finished)
        reasoning += r
        update = stream.feed(text)
        if finished:
            last = stream.finish()
            update.content += last.content
            update.calls += last.calls
        content += update.content
        calls += update.calls
    return reasoning or None, content or None, calls


def _named(calls):
    return [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("text", list(CASES))
def test_reasoning_parser_alone(text):
    reasoning, _, _, content = CASES[text]
    assert REASONING.split(text) == (reasoning, content)
    _no_markup(reasoning, content)
    for pieces in _pieces(text):
        assert _reasoning_stream(REASONING, pieces) == (reasoning, content), pieces


@pytest.mark.parametrize("text", list(CASES))
def test_tool_parser_alone(text):
    """Without the reasoning parser the analysis is dropped: it is no content."""
    _, content, calls, _ = CASES[text]
    parsed = TOOLS.parse(text)
    assert (parsed.content, _named(parsed.calls)) == (content, calls)
    for c in parsed.calls:
        json.loads(c.arguments)
    for pieces in _pieces(text):
        got, got_calls = _tools_stream(pieces)
        assert (got, _named(got_calls)) == (content, calls), pieces


@pytest.mark.parametrize("text", list(CASES))
def test_reasoning_then_tool_parser(text):
    """The chat path's chain: the tool parser reads the reasoning parser's content."""
    reasoning, content, calls, _ = CASES[text]
    chained = REASONING.for_tool_parser(TOOLS)
    said, rest = chained.split(text)
    assert said == reasoning
    parsed = TOOLS.parse(rest or "")
    assert (parsed.content, _named(parsed.calls)) == (content, calls)
    _no_markup(said, parsed.content, *(c.arguments for c in parsed.calls))
    for pieces in _pieces(text):
        r, c, got_calls = _chained_stream(pieces)
        assert (r, c, _named(got_calls)) == (reasoning, content, calls), pieces


def test_a_special_token_split_across_deltas_is_held_back():
    stream = REASONING.stream()
    assert stream.step("<|chan", False) == ("", "")
    assert stream.step("nel|>analysis<|mess", False) == ("", "")
    assert stream.step("age|>Think<", False) == ("Think", "")
    assert stream.step("|end|><|start|>assistant<|channel|>final<|message|>An", False) == (
        "",
        "An",
    )
    assert stream.step("swer<|ret", False) == ("", "swer")
    assert stream.step("urn|>", True) == ("", "")


def test_calls_stream_out_whole_as_each_message_ends():
    stream = TOOLS.stream()
    assert not stream.feed("<|channel|>commentary to=functions.f<|constrain|>json<|message|>{")
    update = stream.feed('"x": 1}<|call|><|start|>assistant<|channel|>commentary to=functions.g')
    assert _named(update.calls) == [("f", '{"x": 1}')] and not update.content
    update = stream.feed("<|message|>{}<|call|>")
    assert _named(update.calls) == [("g", "{}")]
    assert not stream.finish()


def test_headers():
    assert parse_header("assistant<|channel|>commentary to=functions.f <|constrain|>json") == (
        parse_header(" to=functions.f<|channel|>commentary json")
    )
    header = parse_header("assistant to=functions.get_weather<|channel|>commentary json")
    assert (header.channel, header.function, header.kind) == ("commentary", "get_weather", "call")
    assert parse_header("<|channel|>analysis").kind == "reasoning"
    assert parse_header("<|channel|>commentary").kind == "content"  # a preamble
    assert parse_header("assistant").kind == "content"
    assert parse_header("<|channel|>analysis to=browser.search").kind == "reasoning"
    assert parse_header("<|channel|>commentary to=browser.search").kind == "content"


def test_reader_events():
    events = HarmonyReader().feed(ANALYSIS + FINAL, finished=True)
    kinds = [(e.kind, e.header.channel if e.header else None, e.text) for e in events]
    assert kinds == [
        ("open", "analysis", ""),
        ("text", None, "User asks 2+2. Easy."),
        ("close", None, "<|end|>"),
        ("open", "final", ""),
        ("text", None, "The answer is 4."),
        ("close", None, "<|return|>"),
    ]


def test_the_reasoning_parser_fits_the_tool_parser():
    """Calls stay harmony, for the tool parser, only when it reads harmony."""
    assert REASONING.needs_special_tokens and TOOLS.needs_special_tokens
    assert REASONING.for_tool_parser(TOOLS) == HarmonyReasoningParser(keep_calls=True)
    assert REASONING.for_tool_parser(None) is REASONING
    assert REASONING.for_tool_parser(load_tool_parser("hermes")) is REASONING
    r1 = get_reasoning_parser("deepseek_r1")
    assert r1.for_tool_parser(TOOLS) is r1 and not r1.needs_special_tokens
