"""``PoolingParams``: how to turn one prompt into an embedding, named as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    """Per-request options of a pooling (embedding) request.

    ``dimensions``: keep the first ``dimensions`` values of the pooled vector (matryoshka
    truncation; only for models that declare it), renormalised when ``normalize`` is on.
    ``normalize``: L2-normalise the vector; None takes the model's default (a
    sentence-transformers ``Normalize`` module, else on, as vLLM's embedding pooler).
    """

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        from engine.errors import InvalidRequestError

        if self.dimensions is not None and (
            isinstance(self.dimensions, bool)
            or not isinstance(self.dimensions, int)
            or self.dimensions < 1
        ):
            raise InvalidRequestError(
                f"dimensions must be a positive integer, got {self.dimensions!r}", "dimensions"
            )
