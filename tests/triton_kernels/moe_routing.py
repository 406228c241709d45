"""Random top-k routings for the fused MoE kernel tests (``test_triton_fused_moe*.py``)."""

from __future__ import annotations

import torch


def route(
    t: int, e: int, k: int, popular: int | None = None, unused: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` tokens' top-``k`` of ``e`` experts from uniform scores (the global generator):
    ``popular`` gets every token, ``unused`` none. Returns (weights renormalized to sum 1,
    float32 ``[t, k]``; expert ids, int32 ``[t, k]``)."""
    scores = torch.rand(t, e)
    if popular is not None:
        scores[:, popular] += 2.0
    for u in unused:
        scores[:, u] = -1.0
    weights, ids = torch.topk(scores, k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).float(), ids.to(torch.int32)
