"""Beam search, driven above the engine core (vLLM V1's design).

A search never touches the scheduler or the KV cache. Each step it asks its caller to score
every live beam: one engine request per beam whose prompt is the beam's whole token sequence,
with ``max_tokens=1`` and ``logprobs=K`` (``step_params``). The engine's automatic prefix
caching finds the full KV blocks of the prompt and of the tokens the beams have in common, so
beams share them by reference count instead of recomputing or copying them; only each beam's
last, partly filled block is computed again. ``LLM.beam_search`` (offline) and the server's
``use_beam_search`` drive the same ``BeamSearch`` objects over the same engine-core client.

The bookkeeping is Hugging Face transformers' (``generate(num_beams=W, do_sample=False)``,
transformers 4.50+), so that outputs are token-for-token those of ``generate``:

- each step takes the top ``K = max(2, 1 + number of EOS ids) * W`` continuations of all live
  beams by cumulative logprob (every beam returns its own top K, whose union holds the global
  top K);
- a continuation that ends the sequence (an EOS id, unless ``ignore_eos``, or the
  ``max_tokens``-th token) becomes a finished hypothesis only if it ranks among the top W, with
  score ``cum_logprob / generated_len ** length_penalty`` (``generated_len`` counts the
  generated tokens, the EOS included; the prompt is not counted); at most W hypotheses are kept;
- the best W continuations that do not end the sequence are the next step's beams;
- ``early_stopping`` is transformers': ``True`` stops once W hypotheses are finished; ``False``
  stops once the best live beam, scored at its current length, cannot beat the worst of W
  finished hypotheses (a heuristic); ``"never"`` (the default) stops only when no live beam can
  beat them at any length up to ``max_tokens``, which gives exactly the result of running all
  ``max_tokens`` steps (vLLM's extent) in fewer steps.

Where vLLM differs (its ``get_beam_search_score`` divides by the length *with the prompt* and
without the EOS, and it keeps every EOS candidate of every beam), we follow transformers: the
score should not depend on the prompt's length, and the outputs are then checkable against
``generate``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError

EARLY_STOPPING = (True, False, "never")


class BeamSearchParamsError(InvalidRequestError):
    """An invalid ``BeamSearchParams`` field (``param`` names it)."""


@dataclass
class BeamSearchParams:
    """What ``LLM.beam_search`` takes (vLLM's fields, plus transformers' ``early_stopping``).

    ``beam_width``: beams kept per step and sequences returned. ``max_tokens``: tokens generated
    at most. ``temperature`` only changes which token the engine samples alongside the top-K
    logprobs (which are the model's raw logprobs, as in vLLM); 0 is beam search proper.
    ``length_penalty``: the exponent of the generated length that divides a finished
    hypothesis' cumulative logprob. ``include_stop_str_in_output``: keep the EOS token's text
    in ``text``. ``early_stopping``: see the module docstring.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = "never"

    def validate(self) -> None:
        """Raise ``BeamSearchParamsError`` naming the first invalid field."""

        def fail(name: str, want: str) -> None:
            value = getattr(self, name)
            raise BeamSearchParamsError(f"{name} must be {want}, got {value!r}", name)

        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int):
            fail("beam_width", "an integer >= 1")
        if self.beam_width < 1:
            fail("beam_width", "an integer >= 1")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            fail("max_tokens", "an integer >= 1")
        if self.max_tokens < 1:
            fail("max_tokens", "an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature:
            fail("temperature", "a number >= 0")
        if isinstance(self.length_penalty, bool) or not isinstance(
            self.length_penalty, (int, float)
        ):
            fail("length_penalty", "a number")
        if self.length_penalty != self.length_penalty or abs(self.length_penalty) == float("inf"):
            fail("length_penalty", "a finite number")
        if not any(self.early_stopping is v or self.early_stopping == v for v in EARLY_STOPPING):
            fail("early_stopping", 'true, false or "never"')

    def num_candidates(self, num_eos_ids: int) -> int:
        """K: the continuations ranked per step (and the logprobs asked per beam), as
        transformers: ``max(2, 1 + number of EOS ids) * beam_width``."""
        eos = 0 if self.ignore_eos else num_eos_ids
        return max(2, 1 + eos) * self.beam_width


def length_normalized(cum: float, length: int, length_penalty: float) -> float:
    """``cum / length ** length_penalty`` for any finite penalty: a large one makes the power
    overflow (OverflowError) or underflow to 0.0 (ZeroDivisionError); their limits, inf and
    0, keep the order of the scores (``cum`` is a sum of logprobs, <= 0)."""
    try:
        scale = float(length) ** length_penalty
    except OverflowError:
        scale = math.inf
    if scale == 0.0:
        return -math.inf if cum < 0 else 0.0
    return cum / scale


def check_beam_width(params: BeamSearchParams, num_eos_ids: int, max_logprobs: int) -> None:
    """Raise ``BeamSearchParamsError`` (param ``beam_width``) when a step would ask more
    logprobs per beam than the engine returns (``max_logprobs``)."""
    need = params.num_candidates(num_eos_ids)
    if need > max_logprobs:
        per_beam = need // params.beam_width
        raise BeamSearchParamsError(
            f"beam_width must be at most {max_logprobs // per_beam}, got {params.beam_width}: "
            f"each step ranks {per_beam} * beam_width candidates per beam as logprobs and the "
            f"engine returns at most {max_logprobs} (max_logprobs)",
            "beam_width",
        )


@dataclass
class BeamSearchSequence:
    """One returned sequence (vLLM's shape). ``tokens`` holds the prompt and the generated
    tokens (as vLLM's); ``output_tokens`` only the generated ones. ``text`` is the generated
    text (the EOS text only with ``include_stop_str_in_output``). ``logprobs`` has one entry
    per generated token: the logprobs of that step's candidates. ``score`` is
    ``cum_logprob / len(output_tokens) ** length_penalty``, by which sequences are sorted."""

    tokens: list[int]
    logprobs: list[dict[int, float]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS id) or "length"
    stop_reason: int | None = None  # the EOS id that ended it
    num_prompt_tokens: int = 0
    score: float = 0.0

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best sequences of one prompt, best first (vLLM's shape)."""

    sequences: list[BeamSearchSequence]
    prompt_token_ids: list[int] = field(default_factory=list)


@dataclass
class _Beam:
    tokens: list[int]  # generated only
    logprobs: list[dict[int, float]]
    cum: float


class BeamSearch:
    """The search for one prompt. Drive it with::

    while not search.done:
        scores = [score(search.prompt_token_ids + b) for b in search.live_sequences()]
        search.advance(scores)  # per live beam: {token id: logprob}, at least K of them
    sequences = search.results(decode)
    """

    def __init__(
        self,
        prompt_token_ids: Sequence[int],
        params: BeamSearchParams,
        eos_token_ids: Sequence[int],
    ) -> None:
        params.validate()
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.k = params.num_candidates(len(set(eos_token_ids)))
        self._live = [_Beam([], [], 0.0)]
        self._finished: list[tuple[float, _Beam]] = []  # (score, beam), best first, <= W
        self._generated = 0
        self.done = False

    def live_sequences(self) -> list[list[int]]:
        """The token ids (prompt included) of every beam to score this step."""
        return [self.prompt_token_ids + b.tokens for b in self._live]

    def advance(self, candidates: Sequence[dict[int, float]]) -> None:
        """Take one step: ``candidates[i]`` maps token ids to logprobs after live beam i (its
        top K at least; more are cut)."""
        params, k, width = self.params, self.k, self.params.beam_width
        ranked: list[tuple[float, int, int, float]] = []  # (cum, beam index, token, logprob)
        for i, (beam, cands) in enumerate(zip(self._live, candidates, strict=True)):
            top = sorted(cands.items(), key=lambda kv: -kv[1])[:k]
            ranked.extend((beam.cum + lp, i, token, lp) for token, lp in top)
        ranked.sort(key=lambda c: (-c[0], c[1]))
        ranked = ranked[:k]
        self._generated += 1
        length = self._generated
        at_limit = length >= params.max_tokens
        live: list[_Beam] = []
        finished = list(self._finished)
        for rank, (cum, i, token, _lp) in enumerate(ranked):
            parent = self._live[i]
            ends = at_limit or token in self.eos_ids
            if ends and rank >= width:
                continue  # transformers keeps only the top-W continuations as hypotheses
            if not ends and len(live) >= width:
                continue
            beam = _Beam(parent.tokens + [token], parent.logprobs + [candidates[i]], cum)
            if ends:
                finished.append((length_normalized(cum, length, params.length_penalty), beam))
            else:
                live.append(beam)
        finished.sort(key=lambda f: -f[0])  # stable: earlier hypotheses win ties
        self._finished = finished[:width]
        self._live = live
        self.done = at_limit or not live or self._cannot_improve()

    def _cannot_improve(self) -> bool:
        params = self.params
        if len(self._finished) < params.beam_width:
            return False
        if params.early_stopping is True:
            return True
        best_live = max(b.cum for b in self._live)
        length = self._generated
        if params.early_stopping == "never" and params.length_penalty > 0.0:
            length = params.max_tokens
        best_possible = length_normalized(best_live, length, params.length_penalty)
        return best_possible <= self._finished[-1][0]

    def results(self, decode: Any = None) -> BeamSearchOutput:
        """The finished hypotheses, best first. ``decode(token_ids) -> str`` fills ``text``
        (None: empty text)."""
        out = []
        prompt = self.prompt_token_ids
        for score, beam in self._finished:
            last = beam.tokens[-1] if beam.tokens else None
            stopped = last is not None and last in self.eos_ids
            shown = beam.tokens
            if stopped and not self.params.include_stop_str_in_output:
                shown = beam.tokens[:-1]
            out.append(
                BeamSearchSequence(
                    tokens=prompt + beam.tokens,
                    logprobs=beam.logprobs,
                    cum_logprob=beam.cum,
                    text=decode(shown) if decode is not None else "",
                    finish_reason="stop" if stopped else "length",
                    stop_reason=last if stopped else None,
                    num_prompt_tokens=len(prompt),
                    score=score,
                )
            )
        return BeamSearchOutput(out, list(prompt))

    def step_params(self, max_logprobs: int = 20) -> Any:
        """The ``SamplingParams`` of this search's per-beam engine requests: one token, its
        top K logprobs, no detokenization (the search decodes its results once), and none of
        the model's default sampling settings (penalties would change the logprobs)."""
        from engine.sampling_params import SamplingParams

        return SamplingParams(
            max_tokens=1,
            logprobs=self.k,
            temperature=self.params.temperature,
            ignore_eos=True,
            detokenize=False,
            max_logprobs=max(max_logprobs, self.k),
        )


def logprob_dict(entries: dict[int, Any] | None) -> dict[int, float]:
    """``{token id: logprob}`` of one step's ``{token id: Logprob}``."""
    return {t: float(lp.logprob) for t, lp in (entries or {}).items()}
