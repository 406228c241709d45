"""Turn a channel's engine outputs into per-choice deltas for streaming responses.

One HTTP request may hold several engine requests (one per prompt), each with ``n``
completions: choice ``prompt_index * n + completion_index`` in the response. When the client
reads slower than the engine writes, the outputs of several engine steps are merged into one
delta per choice, so a slow client costs fewer, larger chunks instead of a backlog.

This runs once per token per stream, so it avoids per-call allocations where it can.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.server.async_engine import OutputChannel


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice gained since the last delta."""

    index: int
    prompt_index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, Any] | None] | None
    finish_reason: str | None
    stop_reason: int | str | None
    first: bool  # the first delta of this choice
    output: Any  # the latest RequestOutput (prompt ids, prompt logprobs)


async def stream_deltas(
    channel: OutputChannel, prompt_index: dict[str, int], n: int
) -> AsyncIterator[list[ChoiceDelta]]:
    """Yield, per batch of outputs read from ``channel``, the changed choices in index order.

    Ends when every choice has finished.
    """
    if n == 1 and len(prompt_index) == 1:
        async for deltas in _single_choice_deltas(channel):
            yield deltas
        return
    total = len(prompt_index) * n
    sent = [0] * total  # tokens delivered per choice
    started = [False] * total
    done = [False] * total
    remaining = total
    while remaining:
        outs = await channel.get()
        merged: dict[int, ChoiceDelta] = {}
        for out in outs:
            p = prompt_index[out.request_id]
            new_ids = out.new_token_ids
            new_texts = out.new_texts
            for comp in out.outputs:
                c = comp.index
                idx = p * n + c
                if done[idx]:
                    continue
                ids = new_ids[c] if c < len(new_ids) else ()
                text = new_texts[c] if c < len(new_texts) else ""
                d = merged.get(idx)
                if d is None:
                    d = merged[idx] = ChoiceDelta(
                        idx, p, [], "", None, None, None, not started[idx], out
                    )
                    started[idx] = True
                if ids:
                    start = sent[idx]
                    d.token_ids.extend(ids)
                    if comp.logprobs is not None:
                        if d.logprobs is None:
                            d.logprobs = []
                        d.logprobs.extend(comp.logprobs[start : start + len(ids)])
                    sent[idx] = start + len(ids)
                if text:
                    d.text += text
                if comp.finish_reason is not None or out.finished:
                    d.finish_reason = comp.finish_reason or "abort"
                    d.stop_reason = comp.stop_reason
                    done[idx] = True
                    remaining -= 1
                d.output = out
            if out.finished and len(out.outputs) < n:  # defensive: every choice must end
                for c in range(n):
                    idx = p * n + c
                    if not done[idx]:
                        merged[idx] = ChoiceDelta(
                            idx, p, [], "", None, "abort", None, not started[idx], out
                        )
                        started[idx] = done[idx] = True
                        remaining -= 1
        if merged:
            yield list(merged.values()) if len(merged) == 1 else [merged[k] for k in sorted(merged)]


async def _single_choice_deltas(channel: OutputChannel) -> AsyncIterator[list[ChoiceDelta]]:
    """``stream_deltas`` for the common case of one prompt and ``n == 1`` (one choice): the
    same deltas, without the bookkeeping of several choices."""
    first = True
    sent = 0
    while True:
        outs = await channel.get()
        out = outs[-1]
        comp = out.outputs[0]
        if len(outs) == 1:
            ids = out.new_token_ids[0] if out.new_token_ids else []
            text = out.new_texts[0] if out.new_texts else ""
        else:  # a slow reader: merge the steps
            ids = [t for o in outs if o.new_token_ids for t in o.new_token_ids[0]]
            text = "".join(o.new_texts[0] for o in outs if o.new_texts)
        logprobs = None
        if ids and comp.logprobs is not None:
            logprobs = comp.logprobs[sent : sent + len(ids)]
        sent += len(ids)
        finished = out.finished or comp.finish_reason is not None
        finish = (comp.finish_reason or "abort") if finished else None
        yield [ChoiceDelta(0, 0, ids, text, logprobs, finish, comp.stop_reason, first, out)]
        first = False
        if finished:
            return
