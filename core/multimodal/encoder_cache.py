"""What the scheduler knows about image encoding: a per-step encoder budget and which image
embeddings the model runner's encoder cache holds. Device-free: numbers and content hashes.

The model runner keeps image embeddings on the device keyed by content hash
(``engine.multimodal.runner``); ``EncoderCacheManager`` mirrors that cache's contents and sizes
so the scheduler can decide, without a device, which images a step may encode:

* an image a scheduled chunk reaches is **acquired** by its request: a hit when its hash is
  cached (in use by another request, or kept after its last user finished), else a new entry
  that costs ``length`` tokens of the step's encoder budget (``max_num_encoder_input_tokens``)
  and ``length * bytes_per_token`` bytes of the cache;
* a request holds its images until every placeholder of them is computed (a chunk boundary may
  fall inside an image on models that allow it: the embeddings wait in the cache), then
  **releases** them; released entries stay cached, least recently used first in line for
  eviction, so a repeated image is encoded once;
* to make room, unheld entries are **evicted**; their hashes go to the runner with the next
  step (``SchedulerOutput.free_encoder_hashes``, from ``end_step``), so its cache never outgrows the budget.

``plan`` decides, without changing anything, how many of a chunk's tokens can run given the
budget and the cache (the chunk stops before an image that does not fit; with ``no_split``
also before an image that would not end in this step); ``commit`` acquires what the plan
needs once the KV-cache allocation succeeded.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

_GiB = 1 << 30


@dataclass(frozen=True)
class EncoderBudget:
    """The numbers the scheduler reasons about for image inputs.

    ``max_tokens_per_step``: image embeddings the encoder may produce in one step (vLLM's
    ``max_num_encoder_input_tokens``); ``cache_bytes`` the encoder cache's size;
    ``bytes_per_token`` one embedding's size; ``no_split``: an image's placeholder tokens are
    never split over two steps (``disable_chunked_mm_input``, forced for bidirectional image
    attention).
    """

    max_tokens_per_step: int
    cache_bytes: int
    bytes_per_token: int
    no_split: bool = False


@dataclass
class EncoderPlan:
    """The images a chunk needs: ``(feature index, feature, is_hit)`` and the encoder tokens
    the misses cost."""

    items: list[tuple[int, Any, bool]] = field(default_factory=list)
    cost: int = 0


def encoder_budget_for(
    config: Any, spec: Any, dtype_bytes: int, max_num_batched_tokens: int
) -> EncoderBudget:
    """The budget of an engine serving a model whose image inputs are ``spec``
    (``ImageInputSpec``), from ``config`` (``MultiModalConfig``). Raises ``ConfigError`` when
    one image could never be scheduled."""
    from engine.config import ConfigError

    per_token = int(spec.embed_dim) * int(dtype_bytes)
    cache = int(config.mm_encoder_cache_gb * _GiB)
    per_step = config.max_num_encoder_input_tokens or max_num_batched_tokens
    no_split = bool(config.disable_chunked_mm_input or spec.bidirectional)
    n = spec.tokens_per_image
    if n > per_step:
        raise ConfigError(
            f"one image takes {n} encoder tokens but max_num_encoder_input_tokens={per_step}; "
            f"raise it (or --max-num-batched-tokens, its default) to at least {n}"
        )
    if n * per_token > cache:
        raise ConfigError(
            f"one image's embeddings take {n * per_token / 2**20:.1f} MiB, more than "
            f"mm_encoder_cache_gb={config.mm_encoder_cache_gb}; raise --mm-encoder-cache-gb"
        )
    if no_split and n > max_num_batched_tokens:
        reason = (
            "this model's image tokens attend to each other bidirectionally"
            if spec.bidirectional
            else "disable_chunked_mm_input is set"
        )
        raise ConfigError(
            f"{reason}, so one image's {n} placeholder tokens must run in one step, but "
            f"max_num_batched_tokens={max_num_batched_tokens}; raise --max-num-batched-tokens "
            f"to at least {n}"
        )
    return EncoderBudget(per_step, cache, per_token, no_split)


class EncoderCacheManager:
    """The scheduler's mirror of the runner's encoder cache (see the module docstring).

    Counters: ``num_queries`` (images first reached by a request's chunk), ``num_hits`` (of
    which already cached: not encoded again).
    """

    def __init__(self, budget: EncoderBudget) -> None:
        self.budget = budget
        self.capacity = budget.cache_bytes
        self.used_bytes = 0
        self._size: dict[str, int] = {}  # every cached entry: hash -> bytes
        self._refs: dict[str, int] = {}  # held entries: hash -> number of holders
        self._unheld: OrderedDict[str, int] = OrderedDict()  # LRU, oldest first
        self._unheld_bytes = 0
        self._held: dict[str, dict[int, str]] = {}  # request id -> feature index -> hash
        self._new: set[str] = set()  # entries created in the current schedule() call
        self._freed: list[str] = []
        self.num_queries = 0
        self.num_hits = 0

    # ------------------------------------------------------------------ state
    @property
    def num_entries(self) -> int:
        return len(self._size)

    @property
    def num_held(self) -> int:
        """(request, image) pairs holding an entry: 0 when no request is running."""
        return sum(self._refs.values())

    def is_cached(self, identifier: str) -> bool:
        return identifier in self._size

    def cached_hashes(self) -> set[str]:
        return set(self._size)

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    # ------------------------------------------------------------------ scheduling
    def begin_step(self) -> None:
        """Called at the start of every ``schedule()`` (``end_step`` at its end)."""
        self._new.clear()

    def rejection_reason(self, request: Any, max_num_batched_tokens: int) -> str | None:
        """Why ``request``'s images could never be scheduled, or None."""
        b = self.budget
        for i, f in enumerate(request.mm_features):
            if f.length > b.max_tokens_per_step:
                return (
                    f"image {i} of request {request.request_id!r} takes {f.length} encoder "
                    f"tokens, more than max_num_encoder_input_tokens={b.max_tokens_per_step}"
                )
            if f.length * b.bytes_per_token > self.capacity:
                return f"image {i} of request {request.request_id!r} does not fit the encoder cache"
            if b.no_split and f.length > max_num_batched_tokens:
                return (
                    f"image {i} of request {request.request_id!r} has {f.length} placeholder "
                    f"tokens that must run in one step, more than max_num_batched_tokens="
                    f"{max_num_batched_tokens}"
                )
        return None

    def plan(
        self, request: Any, start: int, num_new: int, tokens_left: int
    ) -> tuple[int, EncoderPlan]:
        """How many of the ``num_new`` tokens from ``start`` can run this step, and the images
        they need. Changes nothing. ``tokens_left``: the step's encoder budget still unused."""
        plan = EncoderPlan()
        end = start + num_new
        held = self._held.get(request.request_id, {})
        pending: set[str] = set()
        new_bytes = 0
        pinned = 0  # bytes of unheld entries this plan hits: they cannot be evicted for it
        per_token = self.budget.bytes_per_token
        for i, f in enumerate(request.mm_features):
            if f.offset >= end:
                break
            if f.end <= start or i in held:
                continue
            cut = f.offset - start if f.offset > start else 0
            if self.budget.no_split and end < f.end:
                return cut, plan  # the image would not end in this step: stop before it
            identifier = f.identifier
            hit = identifier in self._size or identifier in pending
            if not hit:
                need = f.length * per_token
                evictable = self._unheld_bytes - pinned
                if (
                    plan.cost + f.length > tokens_left
                    or self.used_bytes + new_bytes + need - evictable > self.capacity
                ):
                    return cut, plan
                plan.cost += f.length
                new_bytes += need
                pending.add(identifier)
            elif identifier in self._unheld and identifier not in pending:
                pinned += self._unheld[identifier]
                pending.add(identifier)
            plan.items.append((i, f, hit))
        return num_new, plan

    def commit(self, request: Any, plan: EncoderPlan) -> list[str]:
        """Acquire the plan's images for ``request``; returns the hashes to encode."""
        to_encode = []
        for index, f, _ in plan.items:
            if self.acquire(request.request_id, index, f.identifier, f.length):
                continue
            to_encode.append(f.identifier)
        return to_encode

    def acquire(self, request_id: str, index: int, identifier: str, length: int) -> bool:
        """Make request ``request_id``'s image ``index`` hold entry ``identifier``; returns
        whether it was cached already (a hit). A miss makes room by evicting unheld entries,
        oldest first."""
        held = self._held.setdefault(request_id, {})
        if index in held:
            return True
        self.num_queries += 1
        hit = identifier in self._size
        if hit:
            self.num_hits += 1
            size = self._unheld.pop(identifier, None)
            if size is not None:
                self._unheld_bytes -= size
        else:
            need = length * self.budget.bytes_per_token
            while self.used_bytes + need > self.capacity and self._unheld:
                old, size = self._unheld.popitem(last=False)
                self._unheld_bytes -= size
                self.used_bytes -= size
                del self._size[old]
                self._freed.append(old)
            self._size[identifier] = need
            self.used_bytes += need
            self._new.add(identifier)
        self._refs[identifier] = self._refs.get(identifier, 0) + 1
        held[index] = identifier
        return hit

    def end_step(self) -> list[str]:
        """Called at the end of every ``schedule()``: the hashes evicted since the last call,
        which the runner drops before it runs the step."""
        self._new.clear()
        freed, self._freed = self._freed, []
        return freed

    # ------------------------------------------------------------------ releasing
    def release_computed(self, request: Any) -> None:
        """Release the images of ``request`` whose placeholders are all computed."""
        held = self._held.get(request.request_id)
        if not held:
            return
        computed = request.num_computed_tokens
        features = request.mm_features
        for index in [i for i in held if features[i].end <= computed]:
            self._release(request.request_id, index)

    def release_all(self, request_id: str) -> None:
        """Release every image of a finished, aborted or preempted request."""
        for index in list(self._held.get(request_id, ())):
            self._release(request_id, index)

    def _release(self, request_id: str, index: int) -> None:
        held = self._held[request_id]
        identifier = held.pop(index)
        if not held:
            del self._held[request_id]
        refs = self._refs[identifier] - 1
        if refs:
            self._refs[identifier] = refs
            return
        del self._refs[identifier]
        size = self._size[identifier]
        if identifier in self._new:
            # Created in this schedule() by a request preempted before its step ran: nothing
            # was encoded, so the entry goes (the runner never had it).
            self._new.discard(identifier)
            del self._size[identifier]
            self.used_bytes -= size
            return
        self._unheld[identifier] = size
        self._unheld_bytes += size
