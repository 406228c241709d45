"""Tool-call parsers and the tool fields of chat requests, without a server.

The streaming property every parser must have: however the generated text is cut into pieces,
the content shown and the calls made are those of the non-streamed parse, and no tool-call
marker of a well-formed call ever reaches the content.
"""

from __future__ import annotations

import json

import pytest

from engine.config import ConfigError, ModelConfig
from engine.server.errors import APIError
from engine.server.tools.parser import (
    TOOL_PARSERS,
    ToolParser,
    ToolParserNotFound,
    load_tool_parser,
    tool_parser_from_flags,
)
from engine.server.tools.request import (
    parse_forced_tool_calls,
    plan_tool_use,
    prepare_tool_history,
    tool_choice_json_schema,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}

# Hermes/Qwen outputs as the models write them.
HERMES_CASES = {
    "text_then_two_calls": (
        "Let me look both up.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
        "Let me look both up.\n",
        [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "Europe/Paris"})],
    ),
    "one_call_only": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京 <b>{}"}}\n</tool_call>',
        None,
        [("get_weather", {"city": "東京 <b>{}"})],
    ),
    "no_call": (
        "The answer is 4 < 5, and <tool is a word.\n",
        "The answer is 4 < 5, and <tool is a word.\n",
        [],
    ),
    "malformed_json": (
        'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>',
        'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>',
        [],
    ),
    "no_name": (
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        [],
    ),
    "good_then_malformed": (
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
        "<tool_call>{oops}</tool_call>",
        "\n<tool_call>{oops}</tool_call>",
        [("get_time", {})],
    ),
    "unclosed_complete_json": (
        'Hi <tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}',
        "Hi ",
        [("get_time", {"tz": "UTC"})],
    ),
    "unclosed_truncated": (
        '<tool_call>{"name": "get_time", "argu',
        '<tool_call>{"name": "get_time", "argu',
        [],
    ),
    "arguments_as_string": (
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>',
        None,
        [("get_weather", {"city": "Oslo"})],
    ),
    "text_after_call": (
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nDone.',
        "\nDone.",
        [("get_time", {})],
    ),
    "partial_marker_at_end": ("Nothing to call <tool_ca", "Nothing to call <tool_ca", []),
    "whitespace_only_answer": ("\n\n", "\n\n", []),
}

LLAMA_CASES = {
    "python_tag_two_calls": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {}}',
        None,
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    "bare_json_call": (
        '\n{"name": "get_weather", "parameters": {"city": "a;b {x}"}}',
        None,
        [("get_weather", {"city": "a;b {x}"})],
    ),
    "arguments_key": (
        '{"name": "get_time", "arguments": {"tz": "UTC"}}',
        None,
        [("get_time", {"tz": "UTC"})],
    ),
    "plain_text": ("Paris is sunny {today}.", "Paris is sunny {today}.", []),
    "json_answer_not_a_call": ('{"answer": 42}', '{"answer": 42}', []),
    "malformed": (
        '{"name": "get_time", "parameters": {]}',
        '{"name": "get_time", "parameters": {]}',
        [],
    ),
    "truncated": (
        '<|python_tag|>{"name": "get_time", "param',
        '<|python_tag|>{"name": "get_time", "param',
        [],
    ),
    "call_then_garbage": (
        '{"name": "get_time", "parameters": {}}; and then',
        "and then",
        [("get_time", {})],
    ),
    "partial_tag_only": ("<|python_t", "<|python_t", []),
}

# Mistral: the v0.3 JSON array and the v11+ name[ARGS]{...} form, with the special tokens kept
# (the server's default for this parser) or skipped by the request.
MISTRAL_CASES = {
    "array_text_then_two_calls": (
        "Let me check both. [TOOL_CALLS] ["
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
        '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
        "Let me check both. ",
        [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "Europe/Paris"})],
    ),
    "array_nested_arguments": (
        '[TOOL_CALLS][{"name": "book", "arguments": '
        '{"guests": [{"name": "Ann [TOOL_CALLS]", "age": 3}], "opts": {"x": null}}}]',
        None,
        [("book", {"guests": [{"name": "Ann [TOOL_CALLS]", "age": 3}], "opts": {"x": None}})],
    ),
    "v11_two_calls": (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "東京 {}]"}[TOOL_CALLS]get_time[ARGS]{}',
        None,
        [("get_weather", {"city": "東京 {}]"}), ("get_time", {})],
    ),
    "v11_text_before": (
        'Sure.\n\n[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}',
        "Sure.\n\n",
        [("get_time", {"tz": "UTC"})],
    ),
    "no_call": ("The [TOOL] list is [1, 2].", "The [TOOL] list is [1, 2].", []),
    "special_tokens_skipped": (  # the request skipped them: nothing marks a call
        ' [{"name": "get_time", "arguments": {}}]',
        ' [{"name": "get_time", "arguments": {}}]',
        [],
    ),
    "array_malformed": (
        'Ok [TOOL_CALLS] [{"name": "get_time", "arguments": {]}]',
        'Ok [TOOL_CALLS] [{"name": "get_time", "arguments": {]}]',
        [],
    ),
    "array_good_then_malformed": (
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"oops": 1}]',
        '{"oops": 1}]',
        [("get_time", {})],
    ),
    "array_cut_after_a_call": (
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, ',
        None,
        [("get_time", {})],
    ),
    "array_truncated": (
        '[TOOL_CALLS][{"name": "get_time", "argu',
        '[TOOL_CALLS][{"name": "get_time", "argu',
        [],
    ),
    "v11_bad_name_is_content": (
        "[TOOL_CALLS]Here is my answer[ARGS]{}",
        "[TOOL_CALLS]Here is my answer[ARGS]{}",
        [],
    ),
    "v11_call_then_truncated": (
        '[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Pa',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa',
        [("get_time", {})],
    ),
    "v11_arguments_not_an_object": (
        "[TOOL_CALLS]get_time[ARGS][1]",
        "[TOOL_CALLS]get_time[ARGS][1]",
        [],
    ),
    "call_then_text": ("[TOOL_CALLS]get_time[ARGS]{}\nDone.", "\nDone.", [("get_time", {})]),
    "partial_marker_at_end": ("See [TOOL_CA", "See [TOOL_CA", []),
    "marker_only": ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
}

# Pythonic: Llama 3.2 / 4 lists of calls, with Llama 4's tags (special tokens kept) or without.
PYTHONIC_CASES = {
    "two_calls": (
        '[get_weather(city="Paris", unit="c"), get_time()]',
        None,
        [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})],
    ),
    "llama4_tags_kept": (
        "<|python_start|>[get_weather(city='Oslo')]<|python_end|>",
        None,
        [("get_weather", {"city": "Oslo"})],
    ),
    "nested_literals": (
        '\n[book(guests=[{"name": "Ann)", "age": 3}, ("Bo", -1.5)], vip=True, note=None, '
        """memo='''it's "(fine"''', code='a\\'b')]""",
        None,
        [
            (
                "book",
                {
                    "guests": [{"name": "Ann)", "age": 3}, ["Bo", -1.5]],
                    "vip": True,
                    "note": None,
                    "memo": 'it\'s "(fine"',
                    "code": "a'b",
                },
            )
        ],
    ),
    "multiline_trailing_comma": (
        '[\n  get_time(tz="UTC"),\n  get_time(tz="CET"),\n]',
        None,
        [("get_time", {"tz": "UTC"}), ("get_time", {"tz": "CET"})],
    ),
    "plain_text": ("Paris is sunny (22C) [source].", "Paris is sunny (22C) [source].", []),
    "python_list_answer": ("[1, 2, 3]", "[1, 2, 3]", []),
    "list_of_words": ("[done] all good", "[done] all good", []),
    "positional_argument": ('[get_weather("Paris")]', '[get_weather("Paris")]', []),
    "not_a_literal": (
        "[get_weather(city=open('/etc/passwd').read())]",
        "[get_weather(city=open('/etc/passwd').read())]",
        [],
    ),
    "set_is_not_json": ("[f(tags={'a'})]", "[f(tags={'a'})]", []),
    "not_json_numbers_or_keys": ("[f(x=1e999, y={1: 2})]", "[f(x=1e999, y={1: 2})]", []),
    "nul_byte": ("[f(x='\0')]", "[f(x='\0')]", []),
    "good_then_malformed": (
        "[get_time(), get_weather(city=x)]",
        "get_weather(city=x)]",
        [("get_time", {})],
    ),
    "truncated": ('[get_weather(city="Par', '[get_weather(city="Par', []),
    "call_then_cut": (
        '[get_time(), get_weather(city="Par',
        'get_weather(city="Par',
        [("get_time", {})],
    ),
    "tag_then_text": ("<|python_start|>Hello", "<|python_start|>Hello", []),
    "text_after_list": ("[get_time()] Done.", "Done.", [("get_time", {})]),
    "partial_tag_only": ("<|python_st", "<|python_st", []),
    "cut_closing_tag": (
        "<|python_start|>[get_time()]<|python_e",
        "<|python_e",
        [("get_time", {})],
    ),
}

# Qwen3-Coder outputs as its chat template has the model write them (no tool schemas here:
# a value is JSON when it reads as JSON, else text).
_QC_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
QWEN3_CODER_CASES = {
    "text_then_call": (
        "I'll check.\n" + _QC_CALL,
        "I'll check.\n",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    "two_calls": (
        _QC_CALL + "\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        None,
        [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})],
    ),
    "multiline_code_value": (
        "<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n"
        "<parameter=content>\ndef f():\n    return {'a': [1, 2]}\n\n</parameter>\n"
        "</function>\n</tool_call>",
        None,
        [("write_file", {"path": "a.py", "content": "def f():\n    return {'a': [1, 2]}\n"})],
    ),
    "json_values": (
        '<tool_call>\n<function=f>\n<parameter=opts>\n{"x": [1, true]}\n</parameter>\n'
        "<parameter=flag>\nfalse\n</parameter>\n</function>\n</tool_call>",
        None,
        [("f", {"opts": {"x": [1, True]}, "flag": False})],
    ),
    "no_call": ("Plain <tool words> here.", "Plain <tool words> here.", []),
    "not_a_function_body": (
        '<tool_call>\n{"name": "f"}\n</tool_call>',
        '<tool_call>\n{"name": "f"}\n</tool_call>',
        [],
    ),
    "unclosed_at_the_end": (
        "<tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n",
        None,
        [("get_time", {"tz": "CET"})],
    ),
}

CASES = (
    [("hermes", name, *case) for name, case in HERMES_CASES.items()]
    + [("qwen3_coder", name, *case) for name, case in QWEN3_CODER_CASES.items()]
    + [("llama3_json", name, *case) for name, case in LLAMA_CASES.items()]
    + [("mistral", name, *case) for name, case in MISTRAL_CASES.items()]
    + [("pythonic", name, *case) for name, case in PYTHONIC_CASES.items()]
)
IDS = [f"{parser}-{name}" for parser, name, *_ in CASES]


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def run_stream(parser: ToolParser, pieces: list[str]) -> tuple[list[str], list]:
    """Feed ``pieces``; return the content pieces shown and the calls made."""
    stream = parser.stream()
    shown, calls = [], []
    for piece in pieces:
        update = stream.feed(piece)
        shown.append(update.content)
        calls += update.calls
    update = stream.finish()
    shown.append(update.content)
    return shown, calls + update.calls


@pytest.mark.parametrize(("parser_name", "name", "text", "content", "calls"), CASES, ids=IDS)
def test_parse_whole_output(parser_name, name, text, content, calls):
    parsed = load_tool_parser(parser_name).parse(text)
    assert parsed.content == content
    assert calls_of(parsed.calls) == calls
    for call in parsed.calls:
        if parser_name == "mistral":  # Mistral templates accept only 9 letters or digits
            assert len(call.id) == 9 and call.id.isalnum() and call.id.isascii()
        else:
            assert call.id.startswith("call_") and len(call.id) > 10
    assert len({c.id for c in parsed.calls}) == len(parsed.calls)


@pytest.mark.parametrize(("parser_name", "name", "text", "content", "calls"), CASES, ids=IDS)
def test_stream_split_anywhere_matches_whole_parse(parser_name, name, text, content, calls):
    parser = load_tool_parser(parser_name)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    splits.append(list(text))  # one character at a time
    for pieces in splits:
        shown, got = run_stream(parser, pieces)
        assert "".join(shown) == (content or ""), pieces
        assert calls_of(got) == calls, pieces
        if calls and parser_name in ("hermes", "qwen3_coder") and "oops" not in text:
            # Well-formed calls: no piece of the markers is ever shown.
            assert not any("<tool" in s or "</tool" in s for s in shown), pieces
        if calls and content is None:
            assert not any(shown), pieces  # nothing but calls: nothing is ever shown
        if parser_name == "mistral" and calls and "[TOOL_CALLS]" not in (content or ""):
            assert not any(m in s for s in shown for m in ("[TOOL", "[ARGS")), pieces


def test_stream_shows_plain_text_without_waiting_for_the_end():
    stream = load_tool_parser("hermes").stream()
    assert stream.feed("Hello wor").content == "Hello wor"
    assert stream.feed("ld <tool").content == "ld "  # "<tool" may start a call: held
    assert stream.feed("bar>").content == "<toolbar>"
    assert stream.feed("<tool_call>{").content == ""
    update = stream.feed('"name": "f", "arguments": {}}</tool_call>')
    assert update.content == "" and calls_of(update.calls) == [("f", {})]


def test_mistral_and_pythonic_hold_back_only_what_may_be_a_call():
    stream = load_tool_parser("mistral").stream()
    assert stream.feed("Hi [TOOL").content == "Hi "  # may become [TOOL_CALLS]
    assert stream.feed("S] and [TOOL_CALLS]get_").content == "[TOOLS] and "
    assert not stream.feed("time[AR")
    update = stream.feed('GS]{"tz": "UTC"}')
    assert update.content == "" and calls_of(update.calls) == [("get_time", {"tz": "UTC"})]
    assert stream.feed("[TOOL_CALLS]two words").content == "[TOOL_CALLS]two words"

    stream = load_tool_parser("pythonic").stream()
    assert not stream.feed(" <|python_start|>[get")  # may still be "[get_time("
    assert stream.feed("_time is").content == " <|python_start|>[get_time is"
    stream = load_tool_parser("pythonic").stream()
    assert not stream.feed('[get_weather(city="Paris"')
    update = stream.feed("), get_ti")
    assert update.content == "" and calls_of(update.calls) == [("get_weather", {"city": "Paris"})]
    update = stream.feed("me(), 42]")
    assert update.content == "42]" and calls_of(update.calls) == [("get_time", {})]


def test_registry_and_server_flags():
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json", "mistral", "pythonic"}
    assert load_tool_parser("hermes").name == "hermes"
    # An out-of-tree parser by qualified name.
    assert load_tool_parser("engine.server.tools.hermes:HermesToolParser").name == "hermes"
    with pytest.raises(
        ToolParserNotFound,
        match="choose one of hermes, llama3_json, mistral, openai, pythonic, qwen3_coder",
    ):
        load_tool_parser("granite")
    with pytest.raises(ToolParserNotFound, match="not a ToolParser"):
        load_tool_parser("json:JSONDecoder")
    assert tool_parser_from_flags(False, None) is None
    assert tool_parser_from_flags(True, "llama3_json").name == "llama3_json"
    with pytest.raises(ConfigError, match="requires --tool-call-parser"):
        tool_parser_from_flags(True, None)
    with pytest.raises(ConfigError, match="requires --enable-auto-tool-choice"):
        tool_parser_from_flags(False, "hermes")
    with pytest.raises(ConfigError, match="unknown tool call parser 'nope'"):
        tool_parser_from_flags(True, "nope")


def test_qwen3_coder_types_values_by_the_tools_schema():
    """With the request's tools, a value is what its parameter's schema says: a string stays
    text even when it reads as JSON; numbers, booleans, objects and nullable strings read."""
    schema = {
        "type": "object",
        "properties": {
            "zip": {"type": "string"},
            "count": {"type": "integer"},
            "ok": {"type": "boolean"},
            "tags": {"type": "array"},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "mode": {"enum": ["1", "2"]},
        },
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    text = (
        "<tool_call>\n<function=f>\n"
        + "".join(
            f"<parameter={k}>\n{v}\n</parameter>\n"
            for k, v in [("zip", "02134"), ("count", "12"), ("ok", "true"), ("tags", '["a"]'),
                         ("note", "null"), ("mode", "1"), ("extra", "7")]
        )
        + "</function>\n</tool_call>"
    )  # fmt: skip
    plan = plan_tool_use(tools, "auto", parser=load_tool_parser("qwen3_coder"))
    [call] = plan.parser.parse(text).calls
    assert json.loads(call.arguments) == {
        "zip": "02134", "count": 12, "ok": True, "tags": ["a"], "note": None, "mode": "1",
        "extra": 7,
    }  # fmt: skip
    # Without the schema the string "12" would be a number: the plan's parser is bound.
    [untyped] = load_tool_parser("qwen3_coder").parse(text.replace("02134", "12")).calls
    assert json.loads(untyped.arguments)["zip"] == 12
    [typed] = plan.parser.parse(text.replace("02134", "12")).calls
    assert json.loads(typed.arguments)["zip"] == "12"


def test_plan_tool_use():
    hermes = load_tool_parser("hermes")
    plan = plan_tool_use([WEATHER], None, parser=hermes)  # tools without tool_choice: auto
    assert plan.parser is hermes and plan.template_tools == [WEATHER]
    plan = plan_tool_use([WEATHER], "none", parser=hermes)
    assert plan.parser is None and plan.template_tools == [WEATHER]  # still shown
    plan = plan_tool_use([WEATHER], "none", parser=None, exclude_tools_when_tool_choice_none=True)
    assert plan.template_tools is None
    assert plan_tool_use(None, None, parser=hermes).parser is None
    plan = plan_tool_use([WEATHER, TIME], "auto", parser=hermes, parallel_tool_calls=False)
    assert len(plan.limit(hermes.parse(HERMES_CASES["text_then_two_calls"][0]).calls)) == 1


@pytest.mark.parametrize(
    ("tools", "tool_choice", "parser", "param", "message"),
    [
        ([], None, True, "tools", "non-empty list"),
        ([{"type": "retrieval"}], None, True, "tools.0.type", "must be 'function'"),
        ([{"type": "function"}], None, True, "tools.0.function", "object with a name"),
        ([{"type": "function", "function": {"name": "a b"}}], None, True,
         "tools.0.function.name", "letters, digits"),
        ([WEATHER, TIME, WEATHER], None, True, "tools.2.function.name", "duplicate tool name"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, True,
         "tools.0.function.parameters", "JSON Schema object"),
        ([{"type": "function", "function": {"name": "f", "description": 3}}], None, True,
         "tools.0.function.description", "must be a string"),
        ([WEATHER], "sometimes", True, "tool_choice", "must be one of none, auto, required"),
        ([WEATHER], {"type": "function"}, True, "tool_choice", "named tool_choice must be"),
        ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, True,
         "tool_choice.function.name", "not in tools (get_weather)"),
        (None, "auto", True, "tool_choice", "only allowed when tools are given"),
        (None, {"type": "function", "function": {"name": "f"}}, True, "tool_choice",
         "only allowed when tools"),
        ([WEATHER], "auto", False, "tool_choice", "--enable-auto-tool-choice and --tool-call-parser"),
        ([WEATHER], None, False, "tool_choice", "--enable-auto-tool-choice"),
    ],
)  # fmt: skip
def test_plan_tool_use_rejects(tools, tool_choice, parser, param, message):
    with pytest.raises(APIError) as e:
        plan_tool_use(tools, tool_choice, parser=load_tool_parser("hermes") if parser else None)
    assert e.value.status_code == 400 and e.value.param == param
    assert message in e.value.message


def test_required_and_named_schemas():
    with_defs = {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {"when": {"$ref": "#/$defs/date"}},
                "$defs": {"date": {"type": "string", "format": "date"}},
            },
        },
    }
    schema = tool_choice_json_schema([WEATHER, TIME, with_defs], "required")
    assert schema["type"] == "array" and schema["minItems"] == 1
    variants = schema["items"]["anyOf"]
    assert [v["properties"]["name"]["enum"] for v in variants] == [
        ["get_weather"],
        ["get_time"],
        ["book"],
    ]
    assert variants[0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert variants[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert "$defs" not in variants[2]["properties"]["parameters"]
    assert schema["$defs"] == {"date": {"type": "string", "format": "date"}}
    assert all(v["required"] == ["name", "parameters"] for v in variants)
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_choice_json_schema([WEATHER, TIME], named) == WEATHER["function"]["parameters"]
    assert tool_choice_json_schema([WEATHER], "auto") is None
    assert tool_choice_json_schema([WEATHER], "none") is None
    clash = {"type": "function", "function": {"name": "b2", "parameters": {"$defs": {"date": {}}}}}
    with pytest.raises(ValueError, match="different \\$defs named 'date'"):
        tool_choice_json_schema([with_defs, clash], "required")
    # What a schema-constrained output parses back to.
    calls = parse_forced_tool_calls(
        '[{"name": "get_time", "parameters": {"tz": "UTC"}}]', "required"
    )
    assert calls_of(calls) == [("get_time", {"tz": "UTC"})]
    calls = parse_forced_tool_calls('{"city": "Rome"}', named)
    assert calls_of(calls) == [("get_weather", {"city": "Rome"})]
    with pytest.raises(ValueError):
        parse_forced_tool_calls('{"city": "Rome"}', "required")


def test_plan_of_forced_tool_use():
    """ "required" and a named function need no parser flags: the plan carries the schema for
    guided decoding and a parser that reads the constrained output back (content if cut)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    plan = plan_tool_use([WEATHER, TIME], "required", parser=None)
    assert plan.json_schema == tool_choice_json_schema([WEATHER, TIME], "required")
    assert plan.template_tools == [WEATHER, TIME] and plan.calls_finish_reason == "tool_calls"
    single = plan_tool_use([WEATHER, TIME], "required", parser=None, parallel_tool_calls=False)
    assert single.json_schema == {**plan.json_schema, "maxItems": 1}
    plan = plan_tool_use([WEATHER, TIME], named, parser=load_tool_parser("hermes"))
    assert plan.json_schema == WEATHER["function"]["parameters"]
    assert plan.calls_finish_reason == "stop"
    parsed = plan.parser.parse('{"city": "Rome"}')
    assert parsed.content is None and calls_of(parsed.calls) == [("get_weather", {"city": "Rome"})]
    assert plan.parser.parse('{"city": "Ro').content == '{"city": "Ro'
    stream = plan.parser.stream()
    assert not stream.feed('{"city": ') and not stream.feed('"Rome"}')  # nothing before the end
    assert calls_of(stream.finish().calls) == [("get_weather", {"city": "Rome"})]
    clash = {"type": "function", "function": {"name": "b2", "parameters": {"$defs": {"d": {}}}}}
    other = {
        "type": "function",
        "function": {"name": "b3", "parameters": {"$defs": {"d": {"x": 1}}}},
    }
    with pytest.raises(APIError) as e:
        plan_tool_use([clash, other], "required", parser=None)
    assert e.value.status_code == 400 and e.value.param == "tools"


def test_prepare_tool_history():
    msg = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": ""}},
        ],
    }  # fmt: skip
    prepare_tool_history(msg, 1)
    assert [c["function"]["arguments"] for c in msg["tool_calls"]] == [{"city": "Paris"}, {}]
    assert msg["tool_calls"][0]["id"] == "call_1"
    prepare_tool_history({"role": "tool", "content": "20C", "tool_call_id": "call_1"}, 2)
    bad = [
        ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]},
         "messages.3.tool_calls.0.function.arguments"),
        ({"role": "assistant", "tool_calls": [{"type": "function"}]}, "messages.3.tool_calls.0"),
        ({"role": "assistant", "tool_calls": "f()"}, "messages.3.tool_calls"),
        ({"role": "user", "tool_calls": []}, "messages.3"),
        ({"role": "tool", "content": "20C"}, "messages.3.tool_call_id"),
    ]  # fmt: skip
    for message, param in bad:
        with pytest.raises(APIError) as e:
            prepare_tool_history(message, 3)
        assert e.value.status_code == 400 and e.value.param == param


def test_served_model_names_config():
    assert ModelConfig("/m").served_model_names == ["/m"]
    assert ModelConfig("/m", served_model_name="a").served_model_names == ["a"]
    config = ModelConfig("/m", served_model_name=["a", "b"])
    assert config.served_model_names == ["a", "b"]
    assert ModelConfig("/m", served_model_name=["a"]).served_model_name == "a"
    for bad in ([], ["a", "a"], ["a", ""], ""):
        with pytest.raises(ConfigError, match="served_model_name"):
            ModelConfig("/m", served_model_name=bad)
