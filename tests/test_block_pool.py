"""BlockPool: reference counts, the LRU free queue, the null block and the prefix-cache index."""

from __future__ import annotations

import pytest

from engine.block_pool import NULL_BLOCK_ID, BlockPool

H1, H2 = b"\x01" * 32, b"\x02" * 32


def test_null_block_is_reserved():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4
    assert pool.num_free_blocks == 4
    blocks = pool.allocate(4)
    assert sorted(blocks) == [1, 2, 3, 4]
    assert NULL_BLOCK_ID not in blocks
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 4
    with pytest.raises(RuntimeError, match="only 0 are free"):
        pool.allocate(1)
    # Freeing or touching the null block is a no-op (tables use it as a placeholder).
    pool.free([NULL_BLOCK_ID])
    pool.touch([NULL_BLOCK_ID])
    assert pool.num_free_blocks == 0 and pool.ref_cnt[NULL_BLOCK_ID] == 0


def test_too_small_pool_is_refused():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)


def test_free_queue_is_lru():
    pool = BlockPool(5)
    a, b, c, d = pool.allocate(4)
    pool.free([c])
    pool.free([a])
    pool.free([d, b])
    assert pool.free_block_ids() == [c, a, d, b]
    assert pool.allocate(2) == [c, a]  # least recently freed first


def test_reference_counts_and_double_free():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.touch([a])
    assert pool.ref_cnt[a] == 2
    pool.free([a])
    assert not pool.is_free(a)
    pool.free([a])
    assert pool.is_free(a) and pool.ref_cnt[a] == 0
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([a])


def test_freed_block_keeps_hash_until_reused():
    pool = BlockPool(4, num_groups=2)
    a, b = pool.allocate(2)
    assert pool.cache(0, a, H1)
    assert pool.cache(1, b, H1)  # same prefix, other group: its own index
    pool.free([a, b])
    # Still findable while free; touch revives it out of the free queue.
    assert pool.lookup(0, H1) == a and pool.lookup(1, H1) == b
    pool.touch([a])
    assert pool.ref_cnt[a] == 1 and not pool.is_free(a)
    pool.free([a])
    # Handing blocks out for new content evicts their hashes.
    got = pool.allocate(3)
    assert set(got) == {1, 2, 3}
    assert pool.lookup(0, H1) is None and pool.lookup(1, H1) is None
    assert pool.block_hash[a] is None and pool.num_evicted == 2


def test_duplicate_prefix_is_not_cached_twice():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache(0, a, H1)
    assert not pool.cache(0, b, H1)  # another block already holds that prefix
    assert not pool.cache(0, a, H2)  # a block holds one prefix
    assert pool.block_hash[b] is None and pool.lookup(0, H1) == a
    pool.reset_prefix_cache()
    assert pool.lookup(0, H1) is None and pool.block_hash[a] is None


def test_evicting_a_block_keeps_a_newer_owner_of_the_hash():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.cache(0, a, H1)
    pool.free([a])
    (b,) = pool.allocate(1)  # the other free block, a still cached
    assert b != a and pool.lookup(0, H1) == a
    pool.free([b])
    pool.allocate(2)  # now a is reused: its hash goes
    assert pool.lookup(0, H1) is None
