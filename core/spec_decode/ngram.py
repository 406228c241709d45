"""Prompt-lookup (n-gram) drafting: propose what followed the last n tokens earlier on.

For a sequence ``t_0 .. t_{L-1}`` (prompt + output), the proposer looks for the longest
suffix of ``prompt_lookup_min .. prompt_lookup_max`` tokens that also occurs earlier, ending
at some ``j < L - 1``; among equally long matches the latest wins. The draft is the tokens
after that occurrence, ``t_{j+1}, t_{j+2}, ...``; when fewer than ``k`` follow it (the match is
close to the end, as in a repeating pattern of period ``P = L - 1 - j``), the pattern is
continued: draft token ``m`` is ``t_{j + 1 + (m mod P)}``.

The search is vectorised with numpy: one comparison over the sequence for the last token,
then one per further suffix token over the surviving candidates only; no Python loop runs
over tokens. Each request keeps its tokens in a growing numpy buffer, so a step only appends
the tokens it added.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from engine.request import Request


def find_draft(tokens: np.ndarray, lookup_min: int, lookup_max: int, k: int) -> np.ndarray:
    """The draft (int64 array of ``k`` tokens, or empty) for the sequence ``tokens``."""
    n = tokens.shape[0]
    if k <= 0 or n < lookup_min + 1:
        return tokens[:0]
    body = tokens[: n - 1]
    # Candidates j: positions before the last where the last token occurs.
    cand = np.flatnonzero(body == tokens[n - 1])
    if cand.size == 0:
        return tokens[:0]
    length = 1
    longest = max(min(lookup_max, n - 1), 1)
    best = cand
    # Extend the match backwards one suffix token at a time, on the survivors only.
    while length < longest:
        shift = length
        ok = cand >= shift
        cand = cand[ok]
        if cand.size == 0:
            break
        cand = cand[body[cand - shift] == tokens[n - 1 - shift]]
        if cand.size == 0:
            break
        length += 1
        best = cand
    if length < lookup_min:
        return tokens[:0]
    j = int(best[-1])  # the latest occurrence of the longest match
    period = n - 1 - j
    return tokens[j + 1 + np.arange(k) % period]


class _Buffer:
    """A request's tokens (prompt + known outputs) in a growing int64 array."""

    __slots__ = ("data", "size")

    def __init__(self, prompt: list[int]) -> None:
        self.data = np.empty(max(64, 2 * len(prompt)), dtype=np.int64)
        self.data[: len(prompt)] = prompt
        self.size = len(prompt)

    def extend(self, values: list[int]) -> None:
        need = self.size + len(values)
        if need > self.data.shape[0]:
            grown = np.empty(max(need, 2 * self.data.shape[0]), dtype=np.int64)
            grown[: self.size] = self.data[: self.size]
            self.data = grown
        self.data[self.size : need] = values
        self.size = need


class NgramProposer:
    """Host-side prompt-lookup proposer (``method="ngram"``): ``propose`` after each step.

    Buffers are keyed by the request object weakly, so a finished request's tokens go with
    it.
    """

    name = "ngram"
    uses_model = False
    # Host-side, from the tokens alone: under tensor parallelism the reporting rank proposes.
    supports_tensor_parallel = True

    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max
        self._buffers: weakref.WeakKeyDictionary[Request, _Buffer] = weakref.WeakKeyDictionary()

    @classmethod
    def supports(cls, config: Any, hf_config: Any = None) -> list[str]:
        """Prompt lookup needs nothing but the tokens: it serves every model."""
        return []

    @classmethod
    def create(cls, config: Any, runner: Any = None) -> NgramProposer:
        spec = config.speculative
        return cls(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)

    def context(self, request: Request, new_tokens: list[int]) -> np.ndarray:
        """The request's known tokens followed by ``new_tokens`` (this step's, not yet in
        ``request.output_token_ids``), as a view of its buffer."""
        buf = self._buffers.get(request)
        if buf is None:
            buf = _Buffer(request.prompt_token_ids)
            self._buffers[request] = buf
        known = request.num_prompt_tokens + request.num_output_tokens
        if buf.size > known:  # a token the buffer got from an earlier call was cut since
            buf.size = known
        if buf.size < known:
            buf.extend(
                request.output_token_ids[
                    buf.size - request.num_prompt_tokens : known - request.num_prompt_tokens
                ]
            )
        base = buf.size
        buf.extend(new_tokens)
        view = buf.data[: buf.size]
        buf.size = base  # the step's tokens join for good once they are in the request
        return view

    def propose(self, request: Request, new_tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``new_tokens``."""
        return find_draft(
            self.context(request, new_tokens), self.lookup_min, self.lookup_max, min(k, self.k)
        ).tolist()
