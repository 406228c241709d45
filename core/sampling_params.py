"""``SamplingParams``: how to sample one request, named and defaulted as in vLLM."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; ``param`` names the field (for the HTTP error body)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class SamplingType(Enum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


_GREEDY_EPS = 1e-5

# The sampler computes in float32: a larger value would be infinite there, and a positive one
# below the smallest normal float32 is zero there (or too close: dividing by it overflows).
_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_TINY = 1.1754943508222875e-38
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
# torch.Generator.manual_seed takes a signed 64-bit seed (vLLM's bounds too).
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1

# The constraints of StructuredOutputsParams; exactly one of them is set.
_CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a formal language (vLLM's ``StructuredOutputsParams``).

    Exactly one constraint is set:

    - ``json``: a JSON schema (a dict, or its JSON text); the output is one JSON value that
      satisfies it.
    - ``json_object=True``: the output is any JSON object.
    - ``regex``: the output fully matches this regular expression.
    - ``choice``: the output is exactly one of these strings.
    - ``grammar``: an EBNF (GBNF) grammar as xgrammar accepts it, starting at rule ``root``.

    ``disable_any_whitespace`` (``json``/``json_object``): JSON output takes one fixed layout
    (``", "`` and ``": "`` separators, no other whitespace) instead of allowing any whitespace
    between tokens, which a weak model may fill with endless blanks.

    The engine compiles the constraint with xgrammar when the request is added; a schema,
    regex or grammar that does not compile is a ``SamplingParamsError`` then.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        self.validate()

    def validate(self) -> None:
        """Raise ``SamplingParamsError`` (param ``structured_outputs``) unless exactly one
        well-typed constraint is set."""
        param = "structured_outputs"
        given = [name for name in _CONSTRAINTS if self._is_set(name)]
        if len(given) != 1:
            which = f"got {', '.join(given)}" if given else "got none"
            raise SamplingParamsError(
                f"structured_outputs must set exactly one of {', '.join(_CONSTRAINTS)}; {which}",
                param,
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    raise SamplingParamsError(
                        f"structured_outputs.json is not valid JSON: {e}", param
                    ) from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise SamplingParamsError(
                    "structured_outputs.json must be a JSON schema (an object), "
                    f"got {type(schema).__name__}",
                    param,
                )
        if self.json_object is not None and self.json_object is not True:
            raise SamplingParamsError(
                f"structured_outputs.json_object must be true, got {self.json_object!r}", param
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingParamsError(
                    f"structured_outputs.{name} must be a non-empty string, got {value!r}", param
                )
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise SamplingParamsError(
                "structured_outputs.choice must be a non-empty list of non-empty strings, "
                f"got {self.choice!r}",
                param,
            )

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        # json_object=False is vLLM's way of leaving it unset.
        return value is not None and value is not False

    @property
    def kind(self) -> str:
        """The name of the constraint that is set (``json``, ``regex``...)."""
        return next(name for name in _CONSTRAINTS if self._is_set(name))

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> StructuredOutputsParams:
        """Build from a dict of the fields (e.g. a request body's ``structured_outputs``);
        an unknown key is a ``SamplingParamsError`` naming the known ones."""
        if not isinstance(value, dict):
            raise SamplingParamsError(
                f"structured_outputs must be an object, got {type(value).__name__}",
                "structured_outputs",
            )
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise SamplingParamsError(
                f"structured_outputs has unknown field(s) {', '.join(unknown)}; "
                f"known: {', '.join(known)}",
                "structured_outputs",
            )
        return cls(**value)


def _is_finite_number(value: Any) -> bool:
    """A real number within the float32 range (not a bool, NaN or infinite)."""
    if isinstance(value, bool):
        return False
    try:
        number = float(value)
    except (TypeError, ValueError):
        return False
    return math.isfinite(number) and abs(number) <= _FLOAT32_MAX


@dataclass
class SamplingParams:
    """Sampling parameters for one request (vLLM's names and defaults).

    ``temperature == 0`` means greedy. ``top_k`` of 0 or -1 disables top-k. ``logprobs=N``
    returns the sampled token's logprob plus the top N; ``prompt_logprobs=N`` does the same for
    every prompt token. ``max_tokens=None`` means "until the context is full".
    ``structured_outputs`` (a ``StructuredOutputsParams``, or a dict of its fields) constrains
    the output to a JSON schema, regex, choice or grammar.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Upper bound for logprobs/prompt_logprobs; the engine sets it from its config.
    max_logprobs: int = field(default=20, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as e:
                raise SamplingParamsError(
                    "logit_bias must map token ids (integers) to floats", "logit_bias"
                ) from e
            if any(not math.isfinite(v) for v in self.logit_bias.values()):
                raise SamplingParamsError(
                    "logit_bias values must be finite numbers (the server takes -100..100)",
                    "logit_bias",
                )
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        """Raise ``SamplingParamsError`` naming the first invalid field and what is allowed."""

        def fail(param: str, allowed: str) -> None:
            raise SamplingParamsError(
                f"{param} must be {allowed}, got {getattr(self, param)!r}", param
            )

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "an integer >= 1")
        for name in _FLOAT_FIELDS:
            # NaN compares false with every bound below (and sampled token 0 every step).
            if not _is_finite_number(getattr(self, name)):
                fail(name, f"a finite number (at most {_FLOAT32_MAX:.7g} in magnitude)")
        if self.temperature < 0:
            fail("temperature", "non-negative (0 means greedy)")
        if not _FLOAT32_TINY <= self.top_p <= 1.0:
            fail("top_p", f"in (0, 1] (at least {_FLOAT32_TINY:.7g}, the smallest float32)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", "0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "in [-2, 2]")
        if not self.repetition_penalty >= _FLOAT32_TINY:
            # A penalty that is 0 in float32 turns masked logits (-inf * 0) into NaN.
            fail(
                "repetition_penalty",
                f"greater than 0 (at least {_FLOAT32_TINY:.7g}, the smallest float32)",
            )
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            fail("max_tokens", "an integer >= 1 (or None)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"at most max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or value < 0 or value > self.max_logprobs
            ):
                fail(name, f"an integer in [0, {self.max_logprobs}] (or None)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError("stop must be a non-empty string or a list of them", "stop")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError(
                "stop_token_ids must be non-negative integers", "stop_token_ids"
            )
        if self.seed is not None and (
            not isinstance(self.seed, int) or not _SEED_MIN <= self.seed <= _SEED_MAX
        ):
            fail("seed", f"an integer in [{_SEED_MIN}, {_SEED_MAX}] (or None)")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                fail("structured_outputs", "a StructuredOutputsParams (or None)")
            if self.min_tokens:
                # The grammar decides where the output ends; forbidding EOS before min_tokens
                # could leave no token allowed at all.
                raise SamplingParamsError(
                    "min_tokens cannot be combined with structured_outputs (the grammar "
                    "decides where the output ends); leave min_tokens at 0",
                    "min_tokens",
                )

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM_SEED if self.seed is not None else SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type is SamplingType.GREEDY

    @property
    def reads_output_tokens(self) -> bool:
        """Whether sampling depends on the tokens generated so far: repetition, frequency or
        presence penalties, a ``min_tokens`` still to reach, or structured outputs (the
        grammar's state follows every token)."""
        return bool(
            self.min_tokens
            or self.structured_outputs is not None
            or self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def clone(self) -> SamplingParams:
        from copy import deepcopy

        return deepcopy(self)
