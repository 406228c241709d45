"""Tests for engine.detokenizer with tokenizers built offline (byte-level BPE, sentencepiece)."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import (
    IncrementalDetokenizer,
    StopStringChecker,
    check_stop_strings,
    decode_logprob_tokens,
    pending_stop_chars,
)
from engine.outputs import Logprob

CORPUS = [
    "Hello world, this is a test of the tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. 東京 is the capital of Japan.",
    "Numbers 12345 and symbols: #$%&! are fine.",
] * 10

TEXTS = [
    " Hello world, the fox jumps.",
    " 世界你好, 東京 and Paris!",
    " emoji 😀👍🏽 and flags 🇫🇷 mixed with text",
    " café naïve résumé — “quotes” …",
    "\nNew line\n\n  double  spaces\tand tab",
    " 한국어 텍스트 and عربى",
]


def byte_level_bpe() -> PreTrainedTokenizerFast:
    """GPT-2 style: byte-level pre-tokenizer and decoder; rare characters split into bytes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def sentencepiece_style(strip_first_space: bool) -> PreTrainedTokenizerFast:
    """Sentencepiece BPE with byte fallback (``<0xE4>`` tokens for unknown characters).

    ``strip_first_space`` builds the Llama flavour (a "▁" is prepended to the text and the
    decoder strips the first leading space); otherwise the Gemma flavour (spaces kept as is).
    """
    specials = ["<unk>", "<s>", "</s>"]
    scheme = "first" if strip_first_space else "never"
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    base.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    spec = json.loads(base.to_str())["model"]
    vocab = dict(spec["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if strip_first_space:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


TOKENIZERS = {
    "byte_level_bpe": byte_level_bpe,
    "sentencepiece_llama": lambda: sentencepiece_style(strip_first_space=True),
    "sentencepiece_gemma": lambda: sentencepiece_style(strip_first_space=False),
}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request) -> PreTrainedTokenizerFast:
    tok = TOKENIZERS[request.param]()
    tok.flavour = request.param
    return tok


def run_incremental(tok, prompt_ids, output_ids, chunk=1, **kwargs) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt_ids, **kwargs)
    deltas = [detok.add_tokens(output_ids[i : i + chunk]) for i in range(0, len(output_ids), chunk)]
    deltas.append(detok.flush())
    assert detok.output_text == "".join(deltas)
    return deltas, detok.output_text


def expected_continuation(tok, prompt_ids, output_ids, skip=True) -> str:
    full = tok.decode(prompt_ids + output_ids, skip_special_tokens=skip)
    prompt = tok.decode(prompt_ids, skip_special_tokens=skip)
    assert full.startswith(prompt)
    return full[len(prompt) :]


def test_test_tokenizers_split_characters_into_bytes(tokenizer):
    # The fixtures are only useful if some characters really span several tokens.
    ids = tokenizer.encode(" 世界😀", add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("chunk", [1, 2, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_matches_full_decode(tokenizer, text, chunk):
    prompt_ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, out = run_incremental(tokenizer, prompt_ids, output_ids, chunk)
    assert not any("\ufffd" in d for d in deltas)  # never a split character
    assert out == expected_continuation(tokenizer, prompt_ids, output_ids)
    if tokenizer.flavour != "sentencepiece_llama":  # no space prepended, none stripped
        assert out == text == tokenizer.decode(output_ids)


@pytest.mark.parametrize("text", TEXTS)
def test_without_prompt_equals_decode_of_output(tokenizer, text):
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    _, out = run_incremental(tokenizer, [], output_ids)
    assert out == tokenizer.decode(output_ids)


def test_sentencepiece_first_word_keeps_its_space():
    tok = sentencepiece_style(strip_first_space=True)
    prompt_ids = tok.encode("The capital of France is", add_special_tokens=False)
    output_ids = tok.encode("Paris.", add_special_tokens=False)  # "▁Paris", "."
    assert tok.convert_ids_to_tokens(output_ids)[0].startswith("▁")
    _, out = run_incremental(tok, prompt_ids, output_ids)
    assert out == " Paris."
    assert tok.decode(output_ids) == "Paris."  # HF strips it when decoding the output alone


def test_multibyte_character_held_until_complete():
    tok = byte_level_bpe()
    ids = tok.encode("ok 😀", add_special_tokens=False)
    partial = [tok.decode(ids[: i + 1]).endswith("\ufffd") for i in range(len(ids))]
    assert sum(partial) >= 2  # the emoji spans several tokens
    detok = IncrementalDetokenizer(tok, [])
    emitted = [detok.add_tokens([t]) for t in ids]
    for i, is_partial in enumerate(partial):
        if is_partial:
            assert emitted[i] == ""
    assert emitted[-1].endswith("😀")
    assert "".join(emitted) == "ok 😀"


def test_flush_releases_incomplete_character():
    tok = byte_level_bpe()
    ids = tok.encode(" 😀", add_special_tokens=False)[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tok, tok.encode("x", add_special_tokens=False))
    text = "".join(detok.add_tokens([t]) for t in ids)
    assert "\ufffd" not in text
    assert text + detok.flush() == tok.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    eos = tokenizer.eos_token_id
    prompt_ids = tokenizer.encode("Hello", add_special_tokens=False)
    output_ids = tokenizer.encode(" world", add_special_tokens=False) + [eos]
    output_ids += tokenizer.encode(" fox 東京", add_special_tokens=False) + [eos]
    _, out = run_incremental(tokenizer, prompt_ids, output_ids, skip_special_tokens=skip)
    assert out == expected_continuation(tokenizer, prompt_ids, output_ids, skip=skip)
    assert (tokenizer.eos_token in out) is not skip


def test_random_ids(tokenizer):
    # Random id sequences end up as the full decode once flushed. For byte-level BPE any ids
    # (broken UTF-8 included). sentencepiece's ByteFallback decoder turns a whole run of byte
    # tokens into U+FFFDs when the run is not valid UTF-8, so a later invalid byte could
    # change an already emitted character; there random ids avoid lone byte tokens and byte
    # runs come from real characters.
    rng = random.Random(0)
    prompt_ids = tokenizer.encode("The fox", add_special_tokens=False)
    byte_level = isinstance(tokenizer.backend_tokenizer.decoder, decoders.ByteLevel)
    byte_ids = {tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    plain_ids = [i for i in range(tokenizer.vocab_size) if byte_level or i not in byte_ids]
    for _ in range(40):
        output_ids: list[int] = []
        while len(output_ids) < rng.randrange(1, 24):
            if rng.random() < 0.3:
                char = rng.choice("世界😀é한👍🏽")
                output_ids += tokenizer.encode(char, add_special_tokens=False)
            else:
                output_ids.append(rng.choice(plain_ids))
        _, out = run_incremental(tokenizer, prompt_ids, output_ids, rng.choice([1, 2, 5]))
        assert out == expected_continuation(tokenizer, prompt_ids, output_ids)


def test_prompt_ending_inside_a_character():
    tok = byte_level_bpe()
    ids = tok.encode(" 😀 done", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    _, out = run_incremental(tok, ids[:cut], ids[cut:])
    assert out == tok.decode(ids[cut:])  # decoded on its own: no lost text


# ---------------------------------------------------------------- stop strings


def test_check_stop_strings_straddling_steps():
    stops = ["STOP"]
    text = ""
    results = []
    for piece in ["Hello wor", "ld ST", "OP and more"]:
        text += piece
        results.append(check_stop_strings(text, len(piece), stops, False))
    assert results[:2] == [None, None]
    assert results[2] == (len("Hello world "), "STOP")
    assert check_stop_strings(text, len("OP and more"), stops, True) == (
        len("Hello world STOP"),
        "STOP",
    )


def test_check_stop_strings_picks_earliest_and_ignores_old_text():
    text = "abc END xyz STOP"
    assert check_stop_strings(text, len(text), ["STOP", "END"], False) == (4, "END")
    # Same start: the earlier listed wins.
    assert check_stop_strings("a<|x|>", 6, ["<|x|>", "<|"], False) == (1, "<|x|>")
    # A match entirely inside text checked before is not reported again.
    assert check_stop_strings("END then more", len(" then more"), ["END"], False) is None
    assert check_stop_strings("abc", 0, ["abc"], False) is None


def test_pending_stop_chars():
    assert pending_stop_chars("foo ST", ["STOP"]) == 2
    assert pending_stop_chars("foo S", ["STOP", "Sx"]) == 1
    assert pending_stop_chars("foo", ["STOP"]) == 0
    assert pending_stop_chars("a<|im", ["<|im_end|>", "\n\n"]) == 4
    assert pending_stop_chars("line\n", ["<|im_end|>", "\n\n"]) == 1
    assert pending_stop_chars("", ["STOP"]) == 0


@pytest.mark.parametrize("include", [False, True])
def test_stop_checker_streaming_never_leaks_the_stop(include):
    checker = StopStringChecker(["STOP"], include)
    streamed = []
    stop = None
    for piece in ["It is ST", "ART time. S", "T", "OP", " ignored"]:
        delta, stop = checker.add_text(piece)
        streamed.append(delta)
        if stop:
            break
    assert stop == "STOP"
    expected = "It is START time. STOP" if include else "It is START time. "
    assert checker.text == expected == "".join(streamed)
    if not include:
        # "ST" was held back until "ART" showed it was not a stop string.
        assert streamed[0] == "It is " and streamed[1] == "START time. "


def test_stop_checker_flush_without_stop():
    checker = StopStringChecker(["</answer>"])
    assert checker.add_text("x </ans") == ("x ", None)
    assert checker.flush() == "</ans"
    assert checker.text == "x </ans"


def test_detokenizer_with_multibyte_stop_string_across_tokens():
    tok = byte_level_bpe()
    ids = tok.encode(" fox 世界 tail", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("The", add_special_tokens=False))
    checker = StopStringChecker(["世界"])
    streamed, stop = "", None
    for t in ids:
        delta, stop = checker.add_text(detok.add_tokens([t]))
        streamed += delta
        if stop:
            break
    assert stop == "世界"
    assert streamed == checker.text == " fox "


def test_decode_logprob_tokens():
    tok = byte_level_bpe()
    ids = tok.encode(" fox 😀", add_special_tokens=False)
    dicts = [None, {ids[0]: Logprob(-0.1, 1), tok.eos_token_id: Logprob(-3.0, 2)}]
    dicts.append({i: Logprob(-1.0, 1) for i in ids[1:]})
    decode_logprob_tokens(tok, dicts)
    assert dicts[1][ids[0]].decoded_token == tok.decode([ids[0]])
    assert dicts[1][tok.eos_token_id].decoded_token == "<|endoftext|>"
    for i in ids[1:]:
        assert dicts[2][i].decoded_token == tok.decode([i])
