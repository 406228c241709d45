"""The physical KV-cache blocks: reference counts, an LRU free queue and the prefix-cache index.

A block is just an integer id ``0 .. num_blocks - 1``; the model runner owns the tensors behind
it. This module only does the bookkeeping:

* ``ref_cnt[b]`` counts the block tables that hold block ``b``. A block with no holder sits in
  the **free queue**, ordered least recently freed first: allocation takes from the front.
* A block whose KV holds a *full* block of some token prefix may carry that prefix's hash
  (``block_hash[b]``) and be listed in the **prefix-cache index** of its KV-cache group. Freeing a
  block keeps its hash, so a later request with the same prefix can revive it from the free queue
  (``touch``) for as long as nobody else has taken it. The hash is evicted only when the block is
  handed out for new content (``allocate``).
* Block 0 is the **null block**: it is never handed out, never freed and never cached. Block
  tables use it as a placeholder for sliding-window blocks that fell out of the window, and
  padded block-table rows may point at it safely because no request owns it. The model runner
  must therefore allocate ``num_blocks`` physical blocks *including* the null block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

NULL_BLOCK_ID = 0


class BlockPool:
    """Reference-counted blocks with an LRU free queue and a per-group prefix-cache index.

    ``num_groups`` is the number of KV-cache groups: a block belongs to one group at a time, and
    each group has its own hash -> block index (the same token prefix has different physical
    blocks, with different layers' KV, in different groups).
    """

    def __init__(self, num_blocks: int, num_groups: int = 1) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache needs at least 2 blocks (one is the reserved null block), "
                f"got num_blocks={num_blocks}"
            )
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.num_blocks = num_blocks
        self.ref_cnt: list[int] = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # The group whose index lists block_hash[b]; meaningful only while block_hash[b] is set.
        self._hash_group: list[int] = [0] * num_blocks
        # Free blocks, least recently freed first. An OrderedDict gives O(1) pop-front, append
        # and removal from the middle (reviving a cached block), all in C.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._index: list[dict[bytes, int]] = [{} for _ in range(num_groups)]
        self.num_evicted = 0  # cached blocks whose hash was dropped to reuse them

    # ------------------------------------------------------------------ sizes
    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold KV (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no holder, cached or not (all of them can be allocated)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one block table."""
        return self.num_blocks - 1 - len(self._free)

    def is_free(self, block_id: int) -> bool:
        """Whether ``block_id`` is in the free queue."""
        return block_id in self._free

    def free_block_ids(self) -> list[int]:
        """The free queue, front (next to be allocated) first. For tests and debugging."""
        return list(self._free)

    # ------------------------------------------------------------------ allocation
    def allocate(self, num: int) -> list[int]:
        """Take ``num`` blocks from the front of the free queue, each with one reference.

        A taken block loses its prefix hash: its KV is about to be overwritten. Raises
        ``RuntimeError`` when fewer than ``num`` blocks are free (callers check first).
        """
        free = self._free
        if num > len(free):
            raise RuntimeError(f"asked for {num} KV blocks but only {len(free)} are free")
        ref_cnt = self.ref_cnt
        block_hash = self.block_hash
        out = []
        for _ in range(num):
            block_id = free.popitem(last=False)[0]
            if block_hash[block_id] is not None:
                self._evict(block_id)
            ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; a block with none left joins the back of the
        free queue (it keeps its hash). Null-block ids are ignored. Freeing a block that has no
        reference raises ``RuntimeError`` (a double free is always a bug)."""
        ref_cnt = self.ref_cnt
        free = self._free
        for block_id in block_ids:
            if block_id == NULL_BLOCK_ID:
                continue
            count = ref_cnt[block_id] - 1
            if count < 0:
                raise RuntimeError(f"KV block {block_id} freed twice")
            ref_cnt[block_id] = count
            if count == 0:
                free[block_id] = None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block, reviving free ones (prefix-cache hits, forks)."""
        ref_cnt = self.ref_cnt
        free = self._free
        for block_id in block_ids:
            if block_id == NULL_BLOCK_ID:
                continue
            if ref_cnt[block_id] == 0:
                del free[block_id]
            ref_cnt[block_id] += 1

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, group: int, block_hash: bytes) -> int | None:
        """The block of ``group`` that holds the prefix ``block_hash``, if still cached."""
        return self._index[group].get(block_hash)

    def group_index(self, group: int) -> dict[bytes, int]:
        """The live hash -> block index of one group (read it, never write it)."""
        return self._index[group]

    def cache(self, group: int, block_id: int, block_hash: bytes) -> bool:
        """Record that ``block_id`` (held, full, computed) holds the prefix ``block_hash``.

        Returns False and leaves the block unhashed when another block already holds that
        prefix (two requests computed the same prefix at the same time), or when the block
        already carries a hash.
        """
        index = self._index[group]
        if block_hash in index or self.block_hash[block_id] is not None:
            return False
        index[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        self._hash_group[block_id] = group
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. after new weights are loaded)."""
        for block_id, block_hash in enumerate(self.block_hash):
            if block_hash is not None:
                self.block_hash[block_id] = None
        for index in self._index:
            index.clear()

    def _evict(self, block_id: int) -> None:
        index = self._index[self._hash_group[block_id]]
        block_hash = self.block_hash[block_id]
        if index.get(block_hash) == block_id:
            del index[block_hash]
        self.block_hash[block_id] = None
        self.num_evicted += 1
