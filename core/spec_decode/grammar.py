"""Structured outputs with speculative decoding: drafts checked against the grammar.

A constrained sequence keeps only the prefix of its drafts that its grammar accepts
(``valid_prefix``: a draft token the grammar forbids would be rejected anyway, and so would
every draft after it). Verifying ``k`` drafts needs ``k + 1`` masks, one per position, for the
grammar state after the first ``j`` drafts (``draft_bitmasks``). Both advance the sequence's
xgrammar matcher through the drafts and roll it back: the matcher itself only ever moves on
tokens that were accepted.
"""

from __future__ import annotations

from typing import Any

import torch


def valid_prefix(matcher: Any, drafts: list[int]) -> list[int]:
    """The longest prefix of ``drafts`` the grammar allows from the matcher's state (up to
    and including a token that ends it)."""
    count = 0
    for token in drafts:
        if not matcher.accept_token(token):
            break
        count += 1
        if matcher.is_terminated():
            break
    if count:
        matcher.rollback(count)
    return drafts[:count]


def draft_bitmasks(
    manager: Any, matcher: Any, drafts: list[int], first: torch.Tensor
) -> torch.Tensor:
    """Packed masks ``[len(drafts) + 1, W]``: row 0 is ``first`` (the matcher's current
    state), row ``j`` the state after the first ``j`` drafts."""
    import xgrammar as xgr  # loaded already: the matcher is xgrammar's

    masks = xgr.allocate_token_bitmask(len(drafts) + 1, manager.vocab_size)
    masks[0] = first
    accepted = 0
    for j, token in enumerate(drafts, start=1):
        if matcher.is_terminated() or not matcher.accept_token(token):
            # Cannot happen for drafts from valid_prefix; the row before already forbids
            # this token, so the rows after it are never reached.
            masks[j:] = masks[j - 1]
            break
        accepted += 1
        matcher.fill_next_token_bitmask(masks, j)
    if accepted:
        matcher.rollback(accepted)
    return masks
