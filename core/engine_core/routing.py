"""Which engine core gets a request (data parallelism), and what each one is doing.

``DataParallelRouter`` picks, for each new request, the least loaded engine core, unless
another core already holds the request's prompt prefix in its KV cache: then that one, as long
as it is not much busier (``imbalance_limit``). A core re-used for a prefix skips computing it.
This is what vLLM's data-parallel load balancer does not do.

The prefix knowledge is the front end's own: it hashes each prompt's full blocks exactly as
the KV-cache manager does (``engine.kv_cache_manager.hash_block``, chained from the same root)
and remembers which core got which block hashes, in an LRU map bounded by ``max_hashes``. It
is a belief, not a query: a core may have evicted a block since, which only costs a miss.

Load is the number of requests a core is running or holding: this front end's own in-flight
requests there (exact), plus what the core's latest stats say other front ends have there.
The router also tracks each request's core and its unfinished completions, so that aborts go
to the right core and loads drop when requests end.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class DataParallelRouter:
    """See the module docstring. ``block_size`` and ``enable_prefix_caching`` are the cores'."""

    def __init__(
        self,
        num_engines: int,
        block_size: int = 16,
        *,
        enable_prefix_caching: bool = True,
        max_hashes: int = 1 << 16,
    ) -> None:
        self.num_engines = num_engines
        self.block_size = block_size
        self.prefix_aware = enable_prefix_caching and num_engines > 1
        self.max_hashes = max_hashes
        self._owner: OrderedDict[bytes, int] = OrderedDict()  # block hash -> engine (LRU)
        self._own = [0] * num_engines  # this front end's unfinished requests per engine
        self._reported = [0] * num_engines  # running + waiting in the engine's last stats
        self._own_at_report = [0] * num_engines
        self._engine_of: dict[str, int] = {}
        self._remaining: dict[str, set[int]] = {}
        self._next = 0  # round-robin among equally loaded engines

    # ------------------------------------------------------------------ choosing
    def load(self, engine: int) -> int:
        """Requests the engine runs or holds, as far as this front end knows."""
        others = max(0, self._reported[engine] - self._own_at_report[engine])
        return self._own[engine] + others

    def choose(self, prompt_token_ids: list[int]) -> tuple[int, list[bytes]]:
        """The engine for a prompt, and the prompt's block hashes (for ``add``)."""
        if self.num_engines == 1:
            return 0, []
        loads = [self.load(e) for e in range(self.num_engines)]
        least = min(loads)
        tied = [e for e in range(self.num_engines) if loads[e] == least]
        pick = tied[self._next % len(tied)]
        hashes: list[bytes] = []
        if self.prefix_aware:
            hashes = self._hashes(prompt_token_ids)
            holder = self._prefix_holder(hashes)
            if holder is not None and loads[holder] - least <= self.imbalance_limit(least):
                return holder, hashes
        self._next += 1
        return pick, hashes

    @staticmethod
    def imbalance_limit(least_load: int) -> int:
        """How many more requests than the least loaded core a prefix holder may have and
        still get a request for its prefix: a quarter more, and at least 4."""
        return max(4, least_load // 4)

    def _hashes(self, token_ids: list[int]) -> list[bytes]:
        from engine.kv_cache_manager import hash_block, root_hash

        bs = self.block_size
        parent = root_hash(None)
        hashes = []
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = hash_block(parent, token_ids[start : start + bs])
            hashes.append(parent)
        return hashes

    def _prefix_holder(self, hashes: list[bytes]) -> int | None:
        """The engine that got the longest prefix of these block hashes, if any."""
        owner = self._owner
        holder = None
        for h in hashes:  # chained hashes: a hit at block k implies blocks 0..k-1
            engine = owner.get(h)
            if engine is None:
                break
            holder = engine
        return holder

    # ------------------------------------------------------------------ bookkeeping
    def add(self, request_id: str, engine: int, n: int, hashes: list[bytes]) -> None:
        """Record that ``request_id`` (``n`` completions) went to ``engine``."""
        self._engine_of[request_id] = engine
        self._remaining[request_id] = set(range(n))
        self._own[engine] += 1
        owner = self._owner
        for h in hashes:
            owner[h] = engine
            owner.move_to_end(h)
        while len(owner) > self.max_hashes:
            owner.popitem(last=False)

    def engine_of(self, request_id: str) -> int | None:
        return self._engine_of.get(request_id)

    def sequence_done(self, request_id: str, index: int) -> None:
        """A completion of the request ended (the core finished it, or a stop string)."""
        remaining = self._remaining.get(request_id)
        if remaining is None:
            return
        remaining.discard(index)
        if not remaining:
            self.request_done(request_id)

    def request_done(self, request_id: str) -> None:
        """The request ended or was aborted (idempotent)."""
        engine = self._engine_of.pop(request_id, None)
        self._remaining.pop(request_id, None)
        if engine is not None:
            self._own[engine] -= 1

    def on_outputs(self, outputs: list[Any]) -> None:
        """Account for the finished completions among a batch of core outputs."""
        for o in outputs:
            if o.finish_reason is not None:
                self.sequence_done(o.request_id, o.index)

    def on_stats(self, engine: int, stats: Any) -> None:
        """An engine's latest stats (its load from every front end)."""
        self._reported[engine] = int(stats.num_running) + int(stats.num_waiting)
        self._own_at_report[engine] = self._own[engine]

    @property
    def num_in_flight(self) -> int:
        return len(self._engine_of)
