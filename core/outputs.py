"""Results handed back to callers, shaped like vLLM's ``RequestOutput``/``CompletionOutput``.

The output classes use ``__slots__``: a server builds one per streaming request per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability, its rank in the vocabulary and its decoded text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# For each position: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (time.monotonic seconds) for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step (streamed) or at the end (offline)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # Tokens/text added by this step only, per completion index (for streaming).
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_texts: list[str] = field(default_factory=list)


@dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's embedding (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class ClassificationOutput:
    """One prompt's class probabilities (vLLM's ``ClassificationOutput``)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ClassificationRequestOutput:
    """The result of classifying one prompt (vLLM's ``ClassificationRequestOutput``)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(slots=True)
class ScoringOutput:
    """One pair's score (vLLM's ``ScoringOutput``)."""

    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """The result of scoring one pair (vLLM's ``ScoringRequestOutput``): ``prompt_token_ids``
    are the two texts' tokens, one after the other."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """The result of one embedding request (vLLM's ``EmbeddingRequestOutput``)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    metrics: RequestMetrics | None = None
