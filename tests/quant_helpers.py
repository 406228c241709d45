"""Helpers for the quantization tests (the model runs come from ``engine.testing.prefill``)."""

from __future__ import annotations

import torch

from engine.testing.prefill import PROMPT, prefill_logits
from engine.testing.prefill import build_model as build

__all__ = ["PROMPT", "build", "compare", "prefill_logits"]


def compare(got: torch.Tensor, want: torch.Tensor, atol: float, margin: float | None = None):
    """Assert ``|got - want| <= atol`` everywhere, and that the greedy token agrees at every
    position where ``want``'s top two logits are more than ``margin`` (default ``2 * atol``)
    apart. Returns (max, mean) absolute difference."""
    diff = (got - want).abs()
    assert float(diff.max()) <= atol, f"max |logit diff| {float(diff.max()):.3g} > {atol}"
    top2 = want.topk(2, dim=-1).values
    separated = (top2[:, 0] - top2[:, 1]) > (2 * atol if margin is None else margin)
    assert bool(separated.any()), "no position with well-separated logits to compare tokens on"
    assert torch.equal(got.argmax(-1)[separated], want.argmax(-1)[separated])
    return float(diff.max()), float(diff.mean())
