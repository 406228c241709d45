"""Acceptance counters of speculative decoding (pure Python: the scheduler keeps them).

The names follow vLLM's ``SpecDecodingStats`` and its Prometheus counters
(``vllm:spec_decode_num_drafts`` and friends): a *draft* is one request's proposal verified
in one step, of ``num_draft_tokens`` tokens, of which the longest verified prefix,
``num_accepted_tokens``, is kept (plus one token the target samples itself).
``num_accepted_tokens_per_pos[j]`` counts the drafts whose token ``j`` was accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Cumulative counters since the engine started."""

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.num_accepted_tokens_per_pos) < self.num_spec_tokens:
            self.num_accepted_tokens_per_pos += [0] * (
                self.num_spec_tokens - len(self.num_accepted_tokens_per_pos)
            )

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one verified draft of ``num_draft_tokens`` tokens, ``num_accepted_tokens``
        of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        for j in range(num_accepted_tokens):
            per_pos[j] += 1

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
        )

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed draft tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified draft yields on average, the target's own token included (vLLM's
        "mean acceptance length": 1 + accepted / drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def log_line(now: SpecDecodingStats, before: SpecDecodingStats, elapsed_s: float) -> str | None:
    """vLLM's "SpecDecoding metrics" log line for the interval between two snapshots (None
    when nothing was drafted in it)."""
    drafts = now.num_drafts - before.num_drafts
    if drafts <= 0:
        return None
    drafted = now.num_draft_tokens - before.num_draft_tokens
    accepted = now.num_accepted_tokens - before.num_accepted_tokens
    per_pos = [
        (a - b) / drafts
        for a, b in zip(
            now.num_accepted_tokens_per_pos, before.num_accepted_tokens_per_pos, strict=False
        )
    ]
    elapsed_s = max(elapsed_s, 1e-9)
    return (
        f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
        f"Accepted throughput: {accepted / elapsed_s:.2f} tokens/s, "
        f"Drafted throughput: {drafted / elapsed_s:.2f} tokens/s, "
        f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
        f"Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in per_pos)}, "
        f"Avg Draft acceptance rate: {100.0 * accepted / max(drafted, 1):.1f}%"
    )


def acceptance_summary(now: SpecDecodingStats, before: SpecDecodingStats) -> dict:
    """The acceptance figures between two snapshots, for benchmark records."""
    drafts = now.num_drafts - before.num_drafts
    drafted = now.num_draft_tokens - before.num_draft_tokens
    accepted = now.num_accepted_tokens - before.num_accepted_tokens
    per_pos = [
        round((a - b) / drafts, 4) if drafts else 0.0
        for a, b in zip(
            now.num_accepted_tokens_per_pos, before.num_accepted_tokens_per_pos, strict=False
        )
    ]
    return {
        "num_drafts": drafts,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
        "acceptance_per_position": per_pos,
    }
