"""Scoring text pairs with an embedding model: the pairing rule of vLLM's score API and the
cosine similarity of two embeddings. Used by ``LLM.score`` and the server's ``/score`` and
``/rerank`` routes (``engine.server.score``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.errors import InvalidRequestError


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of two vectors in float32 (0 when either is all zeros), as
    sentence-transformers' ``util.cos_sim`` computes it."""
    x = np.asarray(a, dtype=np.float32)
    y = np.asarray(b, dtype=np.float32)
    norms = float(np.linalg.norm(x)) * float(np.linalg.norm(y))
    return float(np.dot(x, y) / norms) if norms > 0 else 0.0


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """The pairs to score: one ``text_1`` against every ``text_2`` (1:N), or two lists of the
    same length pairwise (N:N); ``InvalidRequestError`` naming ``text_2`` otherwise."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise InvalidRequestError("text_1 and text_2 need at least one text each", "text_1")
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise InvalidRequestError(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: the pairs are one "
            "text_1 against every text_2 (1:N), or the texts of two lists of the same length "
            "pairwise (N:N)",
            "text_2",
        )
    return list(zip(first, second, strict=True))
