"""The device-free state of one sequence as the scheduler and KV-cache manager see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

# Stands for a sampled token still on the device (asynchronous scheduling).
PLACEHOLDER_TOKEN = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_REJECTED = "rejected"

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "rejected")


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    ``num_computed_tokens`` counts the tokens whose KV is in the cache (prefix-cache hits
    included). The tokens still to feed the model are ``all_token_ids[num_computed_tokens:]``.
    For ``n > 1`` the engine forks children from a parent after its prompt is computed; they
    share the parent's blocks (``parent_id`` records where a child came from).
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower value = scheduled first (vLLM's convention)
    # Extra keys folded into the prefix hash of every block (e.g. a LoRA id or a cache salt).
    cache_salt: str | None = None
    # The request's images (engine.multimodal.MultiModalFeature: content hash, placeholder
    # offset and length, pixel values), sorted by offset. Blocks holding part of an image fold
    # its hash into their prefix hash.
    mm_features: list = field(default_factory=list)
    # The engine's key of the request's LoRA adapter (0: the base model). It is folded into the
    # prefix hash, counted by the scheduler (at most max_loras per step) and mapped to a device
    # slot by the model runner (``engine.lora``).
    lora_id: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on admission
    num_preemptions: int = 0
    # With asynchronous scheduling, sampled tokens not yet on the host sit at the end of
    # ``output_token_ids`` as ``PLACEHOLDER_TOKEN`` until their step completes.
    num_output_placeholders: int = 0
    status: RequestStatus = RequestStatus.WAITING
    parent_id: str | None = None
    # Speculative decoding: draft tokens proposed after the last step, for the next step to
    # verify (set by ``Scheduler.update_draft_token_ids``, consumed by ``schedule``).
    spec_token_ids: list[int] = field(default_factory=list)
    # Free-form per-request data the engine keeps (sampling params, detokenizer state...).
    data: object = None
    # A pooling (embedding) request's ``engine.pooling_params.PoolingParams``: it runs its
    # whole prompt in one step, samples nothing and finishes when that step completes.
    pooling_params: object = None

    @property
    def num_output_tokens(self) -> int:
        """Output tokens whose values are known (placeholders excluded)."""
        return len(self.output_token_ids) - self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
