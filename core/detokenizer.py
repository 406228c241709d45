"""Incremental detokenization, stop strings and logprob token texts.

``IncrementalDetokenizer`` turns the token ids of one sequence into text a few tokens at a
time. Decoding token by token is wrong for real tokenizers: byte-level BPE and sentencepiece
byte-fallback tokens carry fragments of multi-byte UTF-8 characters, and sentencepiece decoders
drop or add the leading space of a word depending on what comes before. So each step decodes a
small window of ids twice -- the already-emitted tail ``ids[prefix_offset:read_offset]`` and
the same tail plus the new ids -- and emits the difference. Text that ends in U+FFFD (an
incomplete character) is held back until the next tokens complete it.

The window starts inside the prompt (its last few tokens), so the first generated word keeps
the space that separates it from the prompt, as vLLM does: the output of a sentencepiece model
reads " Paris" after "The capital of France is", and prompt text + output text is the text of
all ids. Where the tokenizer's decoder keeps leading spaces (byte-level BPE, Gemma), the output
text also equals ``tokenizer.decode(output_ids)``.

Stop strings: ``check_stop_strings`` finds the earliest stop string in the newest text (it may
straddle token boundaries); ``pending_stop_chars`` says how much trailing text could still
become a stop string, which a stream must hold back; ``StopStringChecker`` combines both for
one sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from engine.outputs import Logprob

# How many prompt tokens give the first output tokens their context.
_PROMPT_CONTEXT_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Detokenize one sequence's output ids incrementally (see the module docstring).

    ``add_tokens(new_ids)`` returns only newly finalized text; ``flush()`` returns what is still
    held back (call it when the sequence finishes). ``output_text`` is everything emitted.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._decode = _window_decoder(
            tokenizer, skip_special_tokens, spaces_between_special_tokens
        )
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # A prompt that ends inside a character would make the window's old text longer than
        # the new one; decode the output on its own then.
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            context = []
        self._ids: list[int] = context
        self._prefix_offset = 0  # window start: context for the next decode
        self._read_offset = len(context)  # ids before this are emitted
        self.output_text = ""

    def add_tokens(self, new_ids: Iterable[int]) -> str:
        """Append output ids; return the text they finalize (possibly ``""``)."""
        self._ids.extend(new_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Return the held-back text (e.g. an incomplete character) when the sequence ends."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        old = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new = self._decode(self._ids[self._prefix_offset :])
        # Hold back while the newest bytes do not form a whole character yet, or while the new
        # ids decode to nothing (e.g. skipped special tokens: keep them in the window).
        if len(new) <= len(old) or (new.endswith(_REPLACEMENT_CHAR) and not final):
            return ""
        delta = new[len(old) :]
        # The next window starts at the ids just emitted; older ids are no longer needed.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.output_text += delta
        return delta


def _window_decoder(
    tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool
) -> Callable[[list[int]], str]:
    """``ids -> text`` exactly as ``tokenizer.decode`` with these options, as fast as possible.

    A fast (Rust-backed) HF tokenizer's ``decode`` is its backend's ``decode`` plus an optional
    clean-up; calling the backend directly skips ~10 us of Python per call, which adds up at
    two calls per token per sequence. Anything else goes through ``tokenizer.decode``.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
    )


def check_stop_strings(
    text: str,
    new_text_len: int,
    stops: Sequence[str],
    include_stop_str_in_output: bool,
) -> tuple[int, str] | None:
    """Find the earliest stop string that ends within the last ``new_text_len`` chars of text.

    ``text`` is the whole output text so far, its newest ``new_text_len`` characters just
    added; only matches that overlap them are searched (older text was checked before), so a
    stop string straddling two steps' text is found. Returns ``(truncate_to, stop)``: the output
    text becomes ``text[:truncate_to]`` (the stop string is cut, or kept when
    ``include_stop_str_in_output``). With several matches the one starting first wins (the
    earlier listed on a tie). ``None`` when no stop string matches.
    """
    if new_text_len <= 0:
        return None
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - new_text_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return None
    idx, stop = best
    return (idx + len(stop) if include_stop_str_in_output else idx), stop


def pending_stop_chars(text: str, stops: Sequence[str]) -> int:
    """How many trailing chars of ``text`` could be the start of a stop string.

    A stream must hold these back: if the next tokens complete the stop string they are cut
    from the output. It is the longest suffix of ``text`` that is a proper prefix of a stop.
    """
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class StopStringChecker:
    """Stop strings for one sequence's text, with the hold-back a stream needs.

    Feed each detokenizer delta to ``add_text``; it returns the text safe to stream now and the
    stop string that ended the sequence (or ``None``). ``text`` is the output text (cut at the
    stop string once one matched); ``flush()`` returns the held-back tail when the sequence
    ends for another reason (EOS, length).
    """

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stops = list(stops)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""
        self.stop: str | None = None
        self._streamed = 0  # chars of ``text`` already returned

    def add_text(self, new_text: str) -> tuple[str, str | None]:
        """Append ``new_text``; return ``(text to stream now, matched stop string or None)``."""
        if self.stop is not None:
            raise RuntimeError("add_text after a stop string already ended the sequence")
        self.text += new_text
        match = check_stop_strings(
            self.text, len(new_text), self.stops, self.include_stop_str_in_output
        )
        if match is not None:
            truncate_to, self.stop = match
            self.text = self.text[:truncate_to]
            return self._take(len(self.text)), self.stop
        # A kept stop string streams anyway, so only a cut one needs holding back.
        held = 0 if self.include_stop_str_in_output else pending_stop_chars(self.text, self.stops)
        return self._take(len(self.text) - held), None

    def flush(self) -> str:
        """The held-back tail, for a sequence that ended without a stop string."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        end = max(end, self._streamed)
        out = self.text[self._streamed : end]
        self._streamed = end
        return out


def decode_logprob_tokens(
    tokenizer: Any, logprobs_dicts: Iterable[dict[int, Logprob] | None]
) -> None:
    """Fill ``Logprob.decoded_token`` in place: each token's text decoded on its own.

    ``None`` entries (the first prompt position) are skipped. Special tokens keep their text
    (``</s>``), and a token holding part of a character decodes to U+FFFD, as in vLLM.
    """
    cache: dict[int, str] = {}
    for d in logprobs_dicts:
        if not d:
            continue
        for tok, entry in d.items():
            text = cache.get(tok)
            if text is None:
                text = tokenizer.decode([tok], skip_special_tokens=False)
                cache[tok] = text
            entry.decoded_token = text
