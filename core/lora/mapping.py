"""Which adapter slot each token of a step uses, in the fixed device buffers the LoRA layers read.

The kernels (``add_lora_linear``, ``lora_expand_augmented``) take the mapping three ways at
once: ``token_slots`` (the slot of every token, -1 for none), and the same grouped by slot
(``sorted_tokens``: every token, those of slot 0 first, then slot 1, ..., then the tokens
without an adapter; ``slot_starts``: where each slot's run begins, ``slot_starts[L]`` where the
tokens without an adapter begin), so a GPU kernel can run one launch over every slot with each
program reading one slot's tokens. The host
computes all three once per step (``group_by_slot``) and copies them into ``LoRABatchMapping``'s
buffers; captured CUDA graphs read those same buffers, so a replay serves whatever mapping the
step wrote.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


def group_by_slot(token_slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """``(sorted_tokens, slot_starts)`` of a per-token slot array (int, -1 = no adapter): the
    index of every token, grouped by slot in slot order (stable: token order within a group)
    with the tokens without a slot last, and the ``num_slots + 1`` offsets of each slot's group
    (``slot_starts[num_slots]``: where the tokens without a slot begin). int32 both."""
    slots = np.asarray(token_slots, dtype=np.int64)
    if slots.size and (slots.max() >= num_slots or slots.min() < -1):
        raise ValueError(
            f"token slots must be in [-1, {num_slots}), got {slots.min()}..{slots.max()}"
        )
    # -1 sorts after every slot as num_slots.
    order = np.argsort(np.where(slots < 0, num_slots, slots), kind="stable")
    sorted_tokens = order.astype(np.int32)
    counts = np.bincount(slots[slots >= 0], minlength=num_slots)
    starts = np.zeros(num_slots + 1, dtype=np.int32)
    np.cumsum(counts, out=starts[1:])
    return sorted_tokens, starts


class LoRABatchMapping:
    """The per-token adapter mapping of the current step, shared by every LoRA layer.

    ``token_slots`` / ``sorted_tokens`` (int32 ``[capacity]``) and ``slot_starts`` (int32
    ``[num_slots + 1]``) are fixed device buffers: a layer called with ``T`` tokens passes
    views of their first ``T`` entries to the kernel. Past the step's tokens, ``token_slots``
    is always -1 and ``sorted_tokens`` the identity (entry ``i`` is ``i``), so a captured graph
    padded beyond the step reads "no adapter" there, and the padding rows are each listed once
    among the tokens without an adapter.
    ``active`` tells the layers whether to call the kernel at all (eager steps without any
    adapter skip it; it is forced on while graphs are captured, so the graphs contain it).
    """

    def __init__(self, capacity: int, num_slots: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.device = device
        self.capacity = 0
        self._allocate(capacity)
        self.active = False
        self.graphs_captured = False
        self._written = 0  # rows of token_slots that may hold a slot >= 0
        self._last: np.ndarray | None = None  # the mapping the buffers hold

    def _allocate(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.token_slots = torch.full((self.capacity,), -1, dtype=torch.int32, device=self.device)
        self.sorted_tokens = torch.arange(self.capacity, dtype=torch.int32, device=self.device)
        self.slot_starts = torch.zeros(self.num_slots + 1, dtype=torch.int32, device=self.device)
        self._written = 0
        self._last = None

    def set(self, token_slots: np.ndarray) -> None:
        """Write a step's per-token slots (-1: no adapter) into the device buffers."""
        n = int(token_slots.shape[0])
        if n > self.capacity:
            if self.graphs_captured:
                raise ValueError(
                    f"a step of {n} tokens exceeds the LoRA mapping's {self.capacity} (captured "
                    "graphs read the buffers, so they cannot grow)"
                )
            self._allocate(n)
        any_slot = bool(n) and bool((token_slots >= 0).any())
        if not any_slot and self._written == 0:
            self.active = False
            return
        last = self._last
        if (
            last is not None
            and last.shape == token_slots.shape
            and np.array_equal(last, token_slots)
        ):
            self.active = any_slot  # decode steps of the same batch: the buffers hold it already
            return
        sorted_tokens, starts = group_by_slot(token_slots, self.num_slots)
        # Rows this step does not cover go back to -1 / the identity (a padded graph reads
        # them).
        width = max(n, self._written)
        slots = np.full(width, -1, dtype=np.int32)
        slots[:n] = token_slots
        order = np.arange(width, dtype=np.int32)
        order[:n] = sorted_tokens
        self._copy(self.token_slots, slots)
        self._copy(self.slot_starts, starts)
        self._copy(self.sorted_tokens, order)
        self._written = n if any_slot else 0
        self._last = np.array(token_slots, dtype=np.int32) if any_slot else None
        self.active = any_slot

    def _copy(self, dst: torch.Tensor, values: np.ndarray) -> None:
        src = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32))
        if dst.device.type == "cpu":
            dst[: src.numel()].copy_(src)
        else:
            # Pinned, so the copy does not wait for the step still running (asynchronous
            # scheduling); the caching host allocator keeps the block until the copy ran.
            dst[: src.numel()].copy_(src.pin_memory(), non_blocking=True)

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """Force the LoRA path on with an empty mapping (graph capture and its warm-up)."""
        self.set(np.zeros(0, dtype=np.int32))
        previous, self.active = self.active, True
        try:
            yield
        finally:
            self.active = previous
            self.graphs_captured = True
