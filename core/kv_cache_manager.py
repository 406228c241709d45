"""Per-request block tables over one shared ``BlockPool``, with automatic prefix caching.

Every request gets one block table per KV-cache group (``KVCacheGroupSpec``): layers with the
same sliding window share a group, and all groups draw from one pool. A table covers exactly the
tokens that are computed or scheduled (``num_computed_tokens`` plus this step's new tokens): it
grows on demand, one block at a time, so the only unused slots are in each request's last block.

Sliding-window groups release blocks that fell entirely out of the window. With window ``W`` a
query at position ``p`` reads keys ``p - W + 1 .. p``, so once ``c`` tokens are computed no
future query reads a position below ``c - W + 1``; blocks wholly below it go back to the pool and
their table entries become the null block (``NULL_BLOCK_ID``) so indices stay aligned with
positions.

Prefix caching. A full block's identity is a chained hash: ``h_0 = sha256(root)``, where the root
encodes the request's extra keys (its LoRA adapter and ``cache_salt``), and ``h_k = sha256(h_{k-1}
|| token ids of block k || image hashes)`` with fixed-width token encoding, where the image
hashes are those of the images whose placeholder tokens block k holds (none for text). Hashes
are SHA-256 digests used as the keys themselves: the encoding is injective and SHA-256 is
collision resistant, so two different token prefixes (or adapters, salts, or images) get the
same key with probability ~2^-128 and a request never reads another prompt's KV. Python's
built-in ``hash`` is *not* used: it is 64-bit and trivially collidable on
integer tuples, which a client could exploit to read someone else's cached prompt.

A hit must be valid for *every* group. Full-attention groups need every block of the prefix;
a sliding group only needs the blocks covering the last ``W - 1`` positions before the first
computed token. The longest prefix (in whole blocks, always leaving at least the last token to
compute so there are logits to sample from) satisfying all groups is reused.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from engine.block_pool import NULL_BLOCK_ID, BlockPool
from engine.request import Request

_ROOT_TAG = b"engine/kv-prefix/v1\x00"


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Attention layers that share block tables. ``sliding_window`` is ``W`` in the
    ``p - j < W`` convention, or ``None`` for full attention."""

    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")


def root_hash(cache_salt: str | None, lora_id: int = 0) -> bytes:
    """The hash every block chain of a request starts from: folds in the request's extra keys,
    so requests with different salts or LoRA adapters never share a cached block (the same
    tokens give other KV under another adapter). Without an adapter the digest is the same as
    before adapters existed."""
    h = hashlib.sha256(_ROOT_TAG)
    if lora_id:
        # Starts with b"l", unlike either salt encoding below: the encoding stays injective.
        h.update(b"lora\x00" + int(lora_id).to_bytes(8, "little"))
    if cache_salt is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01" + cache_salt.encode("utf-8"))
    return h.digest()


def hash_block(parent_hash: bytes, token_ids: Sequence[int], extra_keys: bytes = b"") -> bytes:
    """The chained hash of one full block: SHA-256 of the parent's 32-byte digest followed by
    the block's token ids as fixed-width 64-bit integers, then its extra keys (the content
    hashes of the images whose placeholders the block holds; see ``mm_extra_keys``)."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes() + extra_keys).digest()


def mm_extra_keys(features: Sequence, start: int, end: int) -> bytes:
    """The extra keys of the block holding token positions ``start .. end - 1``: the hash of
    every image with a placeholder there (so the same prompt tokens with another image never
    share a block). ``features`` are sorted by offset; empty when no image overlaps."""
    keys = []
    for f in features:
        if f.offset >= end:
            break
        if f.offset + f.length > start:
            identifier = f.identifier.encode()
            keys.append(len(identifier).to_bytes(2, "little") + identifier)
    return b"\x01mm" + b"".join(keys) if keys else b""


def slot_mapping(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Physical slots (``block_id * block_size + offset``) of token positions ``start..end-1``.

    Works a block at a time, so a long prefill chunk costs one ``range`` per block.
    """
    out: list[int] = []
    pos = start
    while pos < end:
        offset = pos % block_size
        base = block_table[pos // block_size] * block_size + offset
        n = min(block_size - offset, end - pos)
        out.extend(range(base, base + n))
        pos += n
    return out


def slot_of(block_table: Sequence[int], position: int, block_size: int) -> int:
    """The physical slot of one token position."""
    return block_table[position // block_size] * block_size + position % block_size


_NEVER = sys.maxsize


class _RequestBlocks:
    """The KV-cache manager's state for one request.

    Besides the tables it caches three thresholds (in tokens) so that a decode step that needs
    no new block, no copy and no release costs a few comparisons: ``capacity`` (slots the
    tables hold; all groups' tables have the same length), ``release_at`` (the computed count
    at which a sliding group's oldest live block falls out of its window) and ``shared_end``
    (positions below it may sit in blocks shared by a fork and must be checked before writing).
    """

    __slots__ = (
        "tables",
        "num_tokens",
        "root",
        "hashes",
        "num_cached_blocks",
        "num_dead",
        "capacity",
        "release_at",
        "shared_end",
    )

    def __init__(self, num_groups: int, root: bytes) -> None:
        self.tables: list[list[int]] = [[] for _ in range(num_groups)]
        self.num_tokens = 0  # tokens the tables cover: computed + scheduled
        self.root = root
        # Chained hashes of the request's full blocks, computed lazily. They depend only on
        # token ids, so they survive preemption.
        self.hashes: list[bytes] = []
        self.num_cached_blocks = 0  # leading blocks already offered to the prefix cache
        self.num_dead = [0] * num_groups  # leading entries replaced by the null block
        self.capacity = 0
        self.release_at = _NEVER
        self.shared_end = 0


def max_blocks_needed(
    groups: list[KVCacheGroupSpec], block_size: int, num_tokens: int, max_chunk: int
) -> int:
    """An upper bound on the blocks one request of ``num_tokens`` tokens holds at once across
    ``groups``, when steps compute at most ``max_chunk`` tokens. A sliding group holds at most
    the blocks spanning ``W - 1`` old positions plus one chunk."""
    total = 0
    for spec in groups:
        full = -(-num_tokens // block_size)
        if spec.sliding_window is None:
            total += full
        else:
            span = spec.sliding_window - 1 + min(max_chunk, num_tokens)
            total += min(full, -(-span // block_size) + 1)
    return total


class KVCacheManager:
    """Block tables, prefix-cache lookups and copy-on-write for the scheduler.

    ``num_blocks`` counts physical blocks *including* the reserved null block 0, so
    ``num_blocks - 1`` hold KV. The scheduler drives it: ``add_request``, then on admission
    ``get_computed_blocks`` + ``admit``, every later step ``allocate_slots``, after each step
    ``cache_full_blocks``, and ``free`` (preemption) or ``remove`` (finish/abort).
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        groups: Sequence[KVCacheGroupSpec],
        enable_prefix_caching: bool = True,
    ) -> None:
        if not groups:
            raise ValueError("at least one KV-cache group is needed")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.groups = list(groups)
        self.num_groups = len(self.groups)
        self.pool = BlockPool(num_blocks, self.num_groups)
        self.enable_prefix_caching = enable_prefix_caching
        self._full_groups = [g for g, s in enumerate(self.groups) if s.sliding_window is None]
        self._sliding_groups = [
            (g, s.sliding_window) for g, s in enumerate(self.groups) if s.sliding_window
        ]
        self._reqs: dict[str, _RequestBlocks] = {}
        # Copy-on-write copies recorded by allocate_slots, per request, until take_copies().
        self._copies: dict[str, list[tuple[int, int]]] = {}
        self.prefix_queries = 0  # tokens looked up on admission
        self.prefix_hits = 0  # of which served from the cache

    # ------------------------------------------------------------------ sizes
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    def max_blocks_needed(self, num_tokens: int, max_chunk: int) -> int:
        """An upper bound on the blocks one request of ``num_tokens`` tokens holds at once,
        when steps compute at most ``max_chunk`` tokens (see ``max_blocks_needed``)."""
        return max_blocks_needed(self.groups, self.block_size, num_tokens, max_chunk)

    # ------------------------------------------------------------------ per request
    def add_request(self, request: Request) -> None:
        """Start tracking ``request`` (no blocks yet)."""
        if request.request_id in self._reqs:
            raise ValueError(f"request {request.request_id!r} already has KV-cache state")
        self._reqs[request.request_id] = _RequestBlocks(
            self.num_groups, root_hash(request.cache_salt, request.lora_id)
        )

    def has_request(self, request_id: str) -> bool:
        return request_id in self._reqs

    def block_tables(self, request_id: str) -> list[list[int]]:
        """The live block tables of a request, one per group (do not modify them)."""
        return self._reqs[request_id].tables

    def num_allocated_tokens(self, request_id: str) -> int:
        """Tokens (computed + scheduled) that the request's tables cover."""
        return self._reqs[request_id].num_tokens

    def get_computed_blocks(self, request: Request) -> tuple[int, list[list[int]] | None]:
        """The longest cached prefix usable by ``request`` in every group.

        Returns ``(num_tokens, tables)``: a multiple of the block size, at most
        ``request.num_tokens - 1``, and per group the blocks to reuse (sliding groups start with
        null placeholders for blocks the first new query cannot see). ``(0, None)`` on a miss.
        Read-only: ``admit`` takes the references.
        """
        if not self.enable_prefix_caching:
            return 0, None
        bs = self.block_size
        k = (request.num_tokens - 1) // bs
        if k <= 0:
            return 0, None
        st = self._reqs[request.request_id]
        hashes = self._ensure_hashes(st, request, k)
        pool = self.pool
        for g in self._full_groups:
            index = pool.group_index(g)
            i = 0
            while i < k and hashes[i] in index:
                i += 1
            k = i
            if k == 0:
                return 0, None
        if self._sliding_groups:
            # run[i] = number of consecutive cached blocks ending at block i.
            runs = []
            for g, window in self._sliding_groups:
                index = pool.group_index(g)
                run, r = [], 0
                for h in hashes[:k]:
                    r = r + 1 if h in index else 0
                    run.append(r)
                runs.append((window, run))
            while k > 0 and not all(
                run[k - 1] >= k - self._first_live_block(k * bs, w) for w, run in runs
            ):
                k -= 1
            if k == 0:
                return 0, None
        tables = []
        for g, spec in enumerate(self.groups):
            index = pool.group_index(g)
            first = (
                0
                if spec.sliding_window is None
                else self._first_live_block(k * bs, spec.sliding_window)
            )
            tables.append([NULL_BLOCK_ID] * first + [index[h] for h in hashes[first:k]])
        return k * bs, tables

    def admit(
        self,
        request: Request,
        num_computed_tokens: int,
        computed_tables: list[list[int]] | None,
        num_new_tokens: int,
        count_query: bool = True,
    ) -> bool:
        """Give a request that holds no blocks its cached prefix plus room for
        ``num_new_tokens`` more. All or nothing: False (and no change) when the pool is short.
        ``count_query`` adds the request to the prefix-cache query/hit counters.
        """
        st = self._reqs[request.request_id]
        pool = self.pool
        bs = self.block_size
        if computed_tables is None:
            computed_tables = [[] for _ in range(self.num_groups)]
        need = -(-(num_computed_tokens + num_new_tokens) // bs)
        ref_cnt = pool.ref_cnt
        # Cached blocks sitting in the free queue stop being allocatable once revived.
        revived = sum(1 for t in computed_tables for b in t if b and ref_cnt[b] == 0)
        new = sum(need - len(t) for t in computed_tables)
        if new + revived > pool.num_free_blocks:
            return False
        # Revive every hit block before allocating: allocation takes from the free queue,
        # where hit blocks of another group may still sit.
        for table in computed_tables:
            pool.touch(table)
        tables = []
        for table in computed_tables:
            table = list(table)
            table.extend(pool.allocate(need - len(table)))
            tables.append(table)
        st.tables = tables
        st.num_tokens = num_computed_tokens + num_new_tokens
        st.num_cached_blocks = num_computed_tokens // bs
        st.num_dead = [
            0
            if s.sliding_window is None
            else self._first_live_block(num_computed_tokens, s.sliding_window)
            for s in self.groups
        ]
        self._refresh(st)
        if self.enable_prefix_caching and count_query:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += num_computed_tokens
        return True

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[list[int]] | None:
        """Make the tables of a running request cover ``num_new_tokens`` more tokens and
        return them (the live tables, one per group), or None when the pool is short.

        Releases sliding-window blocks that fell out of the window first. A block that will be
        written but is shared with another request (the partial last block after a fork) is
        replaced by a fresh copy; the ``(src, dst)`` pair is recorded for ``take_copies``.
        All or nothing: on None the tables are unchanged apart from released blocks.
        """
        st = self._reqs[request.request_id]
        computed = request.num_computed_tokens
        end = computed + num_new_tokens
        # Fast path (most decode steps): room in the last block, nothing to release or copy.
        if end <= st.capacity and computed < st.release_at and computed >= st.shared_end:
            if end > st.num_tokens:
                st.num_tokens = end
            return st.tables
        if self._allocate_slow(st, request.request_id, computed, end):
            return st.tables
        return None

    def _allocate_slow(self, st: _RequestBlocks, rid: str, computed: int, end: int) -> bool:
        bs = self.block_size
        if computed >= st.release_at:
            self._release_out_of_window(st, computed)
        need = (end + bs - 1) // bs
        pool = self.pool
        ref_cnt = pool.ref_cnt
        tables = st.tables
        first_write = computed // bs
        num_new = 0
        shared = None
        for g, table in enumerate(tables):
            have = len(table)
            if need > have:
                num_new += need - have
            if computed < st.shared_end:
                # Existing blocks this step writes into (usually the last one) that a fork
                # still shares.
                for idx in range(first_write, min(have, need)):
                    if ref_cnt[table[idx]] > 1:
                        if shared is None:
                            shared = []
                        shared.append((g, idx))
        if shared is not None:
            num_new += len(shared)
        if num_new > pool.num_free_blocks:
            return False
        if shared is not None:
            copies = self._copies.setdefault(rid, [])
            for g, idx in shared:
                table = tables[g]
                src = table[idx]
                dst = pool.allocate(1)[0]
                pool.free((src,))  # still held by the other sharers
                table[idx] = dst
                copies.append((src, dst))
        if num_new:
            for table in tables:
                if need > len(table):
                    table.extend(pool.allocate(need - len(table)))
        if end > st.num_tokens:
            st.num_tokens = end
        self._refresh(st)
        return True

    def trim(self, request: Request) -> None:
        """Shrink the tables to ``request.num_computed_tokens`` tokens: the blocks past them
        (reserved for draft tokens that were rejected, or for a proposer's look-ahead) go
        back to the pool, last first. Rejected tokens' KV in the kept last block is simply
        overwritten by later steps: no query reads a position before it is recomputed."""
        st = self._reqs[request.request_id]
        computed = request.num_computed_tokens
        if st.num_tokens <= computed:
            return
        st.num_tokens = computed
        keep = -(-computed // self.block_size)
        if keep >= len(st.tables[0]):
            return
        for table in st.tables:
            self.pool.free(reversed(table[keep:]))
            del table[keep:]
        self._refresh(st)

    def cache_full_blocks(self, request: Request) -> None:
        """Offer the request's newly full, computed blocks to the prefix cache."""
        st = self._reqs[request.request_id]
        full = request.num_computed_tokens // self.block_size
        if full <= st.num_cached_blocks or not self.enable_prefix_caching:
            return
        hashes = self._ensure_hashes(st, request, full)
        pool = self.pool
        start = st.num_cached_blocks
        for g, table in enumerate(st.tables):
            for k in range(start, min(full, len(table))):
                block_id = table[k]
                if block_id != NULL_BLOCK_ID:
                    pool.cache(g, block_id, hashes[k])
        st.num_cached_blocks = full

    def fork(self, parent_id: str, child: Request) -> None:
        """Make ``child`` share the parent's blocks covering ``child.num_computed_tokens``
        tokens (one more reference each). The child hashes under the parent's root: it shares
        the parent's prompt, so it belongs to the parent's cache namespace."""
        parent = self._reqs[parent_id]
        if child.request_id in self._reqs:
            raise ValueError(f"request {child.request_id!r} already has KV-cache state")
        bs = self.block_size
        computed = child.num_computed_tokens
        nblocks = -(-computed // bs)
        st = _RequestBlocks(self.num_groups, parent.root)
        st.tables = [table[:nblocks] for table in parent.tables]
        for table in st.tables:
            self.pool.touch(table)
        st.num_tokens = computed
        st.hashes = parent.hashes[: computed // bs]
        st.num_cached_blocks = min(parent.num_cached_blocks, computed // bs)
        st.num_dead = list(parent.num_dead)
        # Until they write past the fork point, parent and child may share their last block.
        st.shared_end = parent.shared_end = max(parent.shared_end, nblocks * bs)
        self._refresh(st)
        self._reqs[child.request_id] = st

    def free(self, request_id: str) -> None:
        """Release every block of a request (preemption) but keep its hashes for a later
        prefix-cache hit. Tail blocks are freed first so they are evicted first."""
        st = self._reqs[request_id]
        for table in st.tables:
            self.pool.free(reversed(table))
        st.tables = [[] for _ in range(self.num_groups)]
        st.num_tokens = 0
        st.num_cached_blocks = 0
        st.num_dead = [0] * self.num_groups
        st.shared_end = 0
        self._refresh(st)
        self._copies.pop(request_id, None)

    def remove(self, request_id: str) -> None:
        """Release every block of a finished or aborted request and forget it (idempotent)."""
        if request_id in self._reqs:
            self.free(request_id)
            del self._reqs[request_id]

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write ``(src, dst)`` block copies recorded since the last call, in the
        order they were made. Run them before the step's forward pass."""
        if not self._copies:
            return []
        out = [pair for pairs in self._copies.values() for pair in pairs]
        self._copies.clear()
        return out

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix."""
        self.pool.reset_prefix_cache()

    # ------------------------------------------------------------------ stats
    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return self.pool.num_used_blocks / self.pool.num_usable_blocks

    def waste_slots(self) -> tuple[int, int]:
        """``(wasted, allocated)`` slots: allocated = held blocks x block size; wasted = those
        not holding a computed or scheduled token. Only a table's last block can be partial; a
        block shared by several tables counts once, as filled as its fullest holder."""
        bs = self.block_size
        fill: dict[int, int] = {}
        for st in self._reqs.values():
            rem = st.num_tokens % bs
            if not rem:
                continue
            for table in st.tables:
                if table:
                    last = table[-1]
                    if fill.get(last, 0) < rem:
                        fill[last] = rem
        allocated = self.pool.num_used_blocks * bs
        wasted = sum(bs - f for f in fill.values())
        return wasted, allocated

    # ------------------------------------------------------------------ helpers
    def _first_live_block(self, num_computed: int, window: int) -> int:
        """Index of the first block a query at position ``num_computed`` can still read."""
        start = num_computed - window + 1
        return start // self.block_size if start > 0 else 0

    def _refresh(self, st: _RequestBlocks) -> None:
        """Recompute the fast-path thresholds after the tables changed."""
        bs = self.block_size
        st.capacity = len(st.tables[0]) * bs
        release_at = _NEVER
        for g, window in self._sliding_groups:
            # Block d dies once (d + 1) * bs <= computed - window + 1.
            at = (st.num_dead[g] + 1) * bs + window - 1
            if at < release_at:
                release_at = at
        st.release_at = release_at

    def _release_out_of_window(self, st: _RequestBlocks, num_computed: int) -> None:
        bs = self.block_size
        for g, window in self._sliding_groups:
            start = num_computed - window + 1
            if start <= 0:
                continue
            first = start // bs
            dead = st.num_dead[g]
            if first <= dead:
                continue
            table = st.tables[g]
            first = min(first, len(table))
            if first > dead:
                # Oldest first: they are the least likely to be revived by a prefix hit.
                self.pool.free(table[dead:first])
                table[dead:first] = [NULL_BLOCK_ID] * (first - dead)
                st.num_dead[g] = first
        self._refresh(st)

    def _ensure_hashes(self, st: _RequestBlocks, request: Request, num_blocks: int) -> list[bytes]:
        hashes = st.hashes
        if len(hashes) < num_blocks:
            bs = self.block_size
            prompt = request.prompt_token_ids
            output = request.output_token_ids
            num_prompt = len(prompt)
            parent = hashes[-1] if hashes else st.root
            features = request.mm_features
            for k in range(len(hashes), num_blocks):
                start, end = k * bs, k * bs + bs
                if end <= num_prompt:
                    tokens = prompt[start:end]
                elif start >= num_prompt:
                    tokens = output[start - num_prompt : end - num_prompt]
                else:
                    tokens = prompt[start:] + output[: end - num_prompt]
                extra = mm_extra_keys(features, start, end) if features else b""
                parent = hash_block(parent, tokens, extra)
                hashes.append(parent)
        return hashes
