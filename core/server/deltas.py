"""Turn a channel's engine outputs into per-choice deltas for streaming responses.

One HTTP request may hold several engine requests (one per prompt), each with ``n``
completions: choice ``prompt_index * n + completion_index`` in the response. When the client
reads slower than the engine writes, the outputs of several engine steps are merged into one
delta per choice, so a slow client costs fewer, larger chunks instead of a backlog.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine.server.async_engine import OutputChannel


@dataclass
class ChoiceDelta:
    """What one choice gained since the last delta."""

    index: int
    prompt_index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Any] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first: bool = False  # the first delta of this choice
    output: Any = None  # the latest RequestOutput (prompt ids, prompt logprobs)


async def stream_deltas(
    channel: OutputChannel, prompt_index: dict[str, int], n: int
) -> AsyncIterator[list[ChoiceDelta]]:
    """Yield, per batch of outputs read from ``channel``, the changed choices in index order.

    Ends when every choice has finished.
    """
    total = len(prompt_index) * n
    sent: dict[int, int] = {}
    done: set[int] = set()
    while len(done) < total:
        merged: dict[int, ChoiceDelta] = {}
        for out in await channel.get():
            p = prompt_index[out.request_id]
            new_ids = out.new_token_ids
            new_texts = out.new_texts
            for comp in out.outputs:
                c = comp.index
                idx = p * n + c
                if idx in done:
                    continue
                d = merged.get(idx)
                if d is None:
                    d = merged[idx] = ChoiceDelta(idx, p, first=idx not in sent)
                    sent.setdefault(idx, 0)
                ids = new_ids[c] if c < len(new_ids) else ()
                if ids:
                    start = sent[idx]
                    d.token_ids.extend(ids)
                    if comp.logprobs is not None:
                        if d.logprobs is None:
                            d.logprobs = []
                        d.logprobs.extend(comp.logprobs[start : start + len(ids)])
                    sent[idx] = start + len(ids)
                if c < len(new_texts):
                    d.text += new_texts[c]
                if comp.finish_reason is not None or out.finished:
                    d.finish_reason = comp.finish_reason or "abort"
                    d.stop_reason = comp.stop_reason
                    done.add(idx)
                d.output = out
        if merged:
            yield [merged[k] for k in sorted(merged)]


def count_tokens(deltas: list[ChoiceDelta]) -> int:
    """Generated tokens in ``deltas``."""
    return sum(len(d.token_ids) for d in deltas)
