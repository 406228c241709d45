"""Static input shapes for platforms that compile one graph per shape (XLA).

On XLA every distinct combination of input shapes is a new graph to compile, so a runner that
feeds each step's exact token count and block-table width would compile on almost every step.
A platform that needs static shapes returns ``ShapeBuckets`` from ``Platform.shape_buckets``;
the model runner then pads each step (``pad_layout``): the token count, the number of sequences
and the block-table width are each rounded up to the next bucket, so a steady decode keeps
replaying one graph and the number of graphs is bounded by the number of bucket combinations.

Padding follows the batch conventions of ``engine.attention_backends.interface``: padded
tokens have slot ``-1`` (nothing is written), padded sequences have query and sequence length
0, padded table entries are block 0 (the null block, never read for a valid position).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from engine.attention_backends.interface import BatchLayout


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """``lo, 2*lo, 4*lo, ...`` up to the first value >= ``hi`` (``lo`` at least 1)."""
    lo = max(1, lo)
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return tuple(out)


@dataclass(frozen=True)
class ShapeBuckets:
    """Ascending padding targets for tokens per step, sequences per step and block-table width.

    A value above the last bucket is an error (the buckets come from the config limits, so it
    means the config and the buckets disagree).
    """

    tokens: tuple[int, ...]
    seqs: tuple[int, ...]
    blocks: tuple[int, ...]

    @classmethod
    def for_limits(
        cls,
        max_tokens: int,
        max_seqs: int,
        max_blocks: int,
        *,
        min_tokens: int = 16,
        min_seqs: int = 8,
        min_blocks: int = 8,
    ) -> ShapeBuckets:
        """Powers of two from the minimums up to the limits (``max_num_batched_tokens``,
        ``max_num_seqs``, blocks of one ``max_model_len`` request)."""
        return cls(
            powers_of_two(min(min_tokens, max_tokens), max_tokens),
            powers_of_two(min(min_seqs, max_seqs), max_seqs),
            powers_of_two(min(min_blocks, max_blocks), max_blocks),
        )

    @staticmethod
    def _pad(value: int, buckets: tuple[int, ...], what: str) -> int:
        i = bisect.bisect_left(buckets, value)
        if i == len(buckets):
            raise ValueError(f"{what}={value} is above the largest shape bucket {buckets[-1]}")
        return buckets[i]

    def pad_tokens(self, n: int) -> int:
        return self._pad(n, self.tokens, "tokens")

    def pad_seqs(self, n: int) -> int:
        return self._pad(n, self.seqs, "sequences")

    def pad_blocks(self, n: int) -> int:
        return self._pad(n, self.blocks, "block-table width")

    def pad_layout(self, layout: BatchLayout, num_tokens: int) -> BatchLayout:
        """``layout`` with padded sequences appended, its slot mapping padded with ``-1`` to
        ``pad_tokens(num_tokens)`` and its table width set to a bucket."""
        seqs = len(layout.query_lens)
        extra = self.pad_seqs(seqs) - seqs
        width = max((len(t) for t in layout.block_tables), default=0)
        slots = list(layout.slot_mapping) + [-1] * (self.pad_tokens(num_tokens) - num_tokens)
        return BatchLayout(
            list(layout.query_lens) + [0] * extra,
            list(layout.seq_lens) + [0] * extra,
            [list(t) for t in layout.block_tables] + [[] for _ in range(extra)],
            slots,
            layout.block_size,
            layout.num_decodes,
            table_width=self.pad_blocks(max(width, 1)),
            shared_prefix=layout.shared_prefix,
        )
