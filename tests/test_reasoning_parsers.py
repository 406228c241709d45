"""The reasoning parsers on their own: whole outputs, and the same outputs cut into deltas at
every position (tags split across deltas) giving the same reasoning and content."""

from __future__ import annotations

import pytest

from engine.server.reasoning import REASONING_PARSERS, get_reasoning_parser

CASES = {
    # text: (deepseek_r1, qwen3)
    "<think>\nLet me add.\n</think>\n\n4": (("\nLet me add.\n", "\n\n4"),) * 2,
    "Let me add.\n</think>\n\n4": (
        ("Let me add.\n", "\n\n4"),
        (None, "Let me add.\n</think>\n\n4"),
    ),
    "<think>still thinking when the budget ran out": (
        ("still thinking when the budget ran out", None),
    )
    * 2,
    "No tags at all.": (("No tags at all.", None), (None, "No tags at all.")),
    "<think></think>Answer": ((None, "Answer"),) * 2,
    "<thin": (("<thin", None), (None, "<thin")),
    "a < b and </thinking> is not a tag": (
        ("a < b and </thinking> is not a tag", None),
        (None, "a < b and </thinking> is not a tag"),
    ),
    "<think>x</think>y</think>z": (("x", "y</think>z"),) * 2,
    "": ((None, None),) * 2,
}


@pytest.mark.parametrize("text", list(CASES))
@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_split_and_every_chunking(name, text):
    parser = get_reasoning_parser(name)
    want = CASES[text][0 if name == "deepseek_r1" else 1]
    assert parser.split(text) == want
    for size in range(1, len(text) + 1):
        stream = parser.stream()
        reasoning, content = "", ""
        pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
        for k, piece in enumerate(pieces):
            r, c = stream.step(piece, finished=k == len(pieces) - 1)
            reasoning, content = reasoning + r, content + c
        assert (reasoning or None, content or None) == want, (size, pieces)


def test_a_tag_split_across_deltas_is_held_back_not_leaked():
    stream = get_reasoning_parser("deepseek_r1").stream()
    assert stream.step("<thi", False) == ("", "")
    assert stream.step("nk>Plan: x</th", False) == ("Plan: x", "")
    assert stream.step("ink>Done", False) == ("", "Done")
    assert stream.step("", True) == ("", "")


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3, openai_gptoss"):
        get_reasoning_parser("o1")
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "openai_gptoss"}
