"""What the scheduler decided for one step: the contract between scheduler and model runner."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    The model consumes ``request.all_token_ids[start:start + num_new_tokens]`` at positions
    ``start .. start + num_new_tokens - 1`` where ``start`` is ``num_computed_tokens`` before the
    step; for a speculative verification the last ``len(spec_token_ids)`` of those tokens are
    the draft tokens ``spec_token_ids`` (not yet in the request), after its one known token. ``block_ids[g]`` is the request's block table for KV-cache group ``g``, covering at
    least ``start + num_new_tokens`` tokens (sliding-window groups may hold placeholder ids for
    blocks that fell out of the window; those are never read). ``samples`` is true when the step
    reaches the end of the known tokens, so a new token is sampled for this request.

    With asynchronous scheduling the scheduler appends a placeholder for the sampled token
    when it schedules the step; ``output_index`` is that placeholder's index in
    ``request.output_token_ids`` (-1 otherwise). A decode's input token may itself be the
    placeholder of the previous step: the model runner takes it from the device.

    Speculative decoding: ``spec_token_ids`` are the drafts this step verifies (the target
    scores all of them in this one forward and keeps the longest accepted prefix plus one
    token of its own); ``num_to_propose`` is how many drafts to propose after the step for the
    next one (0: none). A proposer that writes its own KV for the drafts (a draft model, an
    EAGLE head) has ``num_to_propose`` extra slots in ``block_ids`` past the step's tokens.
    """

    request: Request
    start: int
    num_new_tokens: int
    block_ids: list[list[int]]
    samples: bool
    output_index: int = -1
    spec_token_ids: Sequence[int] = ()
    num_to_propose: int = 0

    @property
    def pools(self) -> bool:
        """A pooling request whose whole prompt runs in this step: its hidden states are
        pooled into its embedding (it never samples)."""
        request = self.request
        return (
            request.pooling_params is not None
            and self.start + self.num_new_tokens >= request.num_prompt_tokens
        )

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.start >= self.request.num_prompt_tokens

    @property
    def num_known_tokens(self) -> int:
        """The step's tokens taken from the request (the rest are ``spec_token_ids``)."""
        return self.num_new_tokens - len(self.spec_token_ids)


@dataclass
class SchedulerOutput:
    """A step: requests in model order (decodes first), plus cache maintenance to do first."""

    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    # (src_block, dst_block) copies for copy-on-write, to run before the forward pass.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # Image inputs: the content hashes the runner's encoder cache must drop before this step
    # (evicted to make room), and, per request, those this step encodes (cache misses).
    free_encoder_hashes: list[str] = field(default_factory=list)
    scheduled_encoder_inputs: dict[str, list[str]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
