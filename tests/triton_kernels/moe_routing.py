"""Random top-k routings for the fused MoE kernel tests (``test_triton_fused_moe*.py``), and a\ncounter of which way through the experts (decode GEMVs or grouped GEMMs) the engine took."""

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


def count_expert_paths(monkeypatch, fm) -> dict[str, int]:
    """Count the launches of ``engine_triton.kernels.fused_moe``'s two ways through the experts
    (``fm._run_decode`` / ``fm._run_grouped``, patched for the test): the returned dict's
    ``"decode"`` and ``"grouped"`` go up by one per call."""
    calls = {"decode": 0, "grouped": 0}
    for variant in calls:
        run = getattr(fm, f"_run_{variant}")

        def counted(*args, _run=run, _variant=variant):
            calls[_variant] += 1
            return _run(*args)

        monkeypatch.setattr(fm, f"_run_{variant}", counted)
    return calls
