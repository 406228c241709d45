"""KVCacheManager: block tables grown on demand, prefix caching, copy-on-write, sliding windows."""

from __future__ import annotations

import pytest

from engine.block_pool import NULL_BLOCK_ID
from engine.kv_cache_manager import (
    KVCacheGroupSpec,
    KVCacheManager,
    hash_block,
    root_hash,
    slot_mapping,
    slot_of,
)
from engine.request import Request

FULL = KVCacheGroupSpec()


def make(num_blocks=20, block_size=4, groups=(FULL,), caching=True) -> KVCacheManager:
    return KVCacheManager(block_size, num_blocks, list(groups), enable_prefix_caching=caching)


def add(kv: KVCacheManager, rid: str, prompt, salt=None) -> Request:
    request = Request(rid, list(prompt), max_tokens=8, cache_salt=salt)
    kv.add_request(request)
    return request


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None) -> int:
    """Admit with the prefix-cache lookup, like the scheduler; returns the hit tokens."""
    hit, tables = kv.get_computed_blocks(request)
    n = request.num_tokens - hit if num_new is None else num_new
    assert kv.admit(request, hit, tables, n)
    request.num_computed_tokens = hit
    return hit


def step(kv: KVCacheManager, request: Request, n: int, sample: int | None = None) -> None:
    """Pretend the model computed n tokens (and sampled one)."""
    request.num_computed_tokens += n
    if sample is not None:
        request.output_token_ids.append(sample)
    kv.cache_full_blocks(request)


def test_hashes_are_chained_salted_and_content_exact():
    root = root_hash(None)
    assert root != root_hash("tenant-a") != root_hash("tenant-b")
    assert root_hash("") != root  # an empty salt is still a salt
    h = hash_block(root, [1, 2, 3, 4])
    assert len(h) == 32 and h == hash_block(root, (1, 2, 3, 4))
    assert h != hash_block(root, [1, 2, 3, 5])
    assert hash_block(h, [5, 6, 7, 8]) != hash_block(hash_block(root, [9, 9, 9, 9]), [5, 6, 7, 8])
    # Fixed-width encoding: token 256 is not tokens (0, 1).
    assert hash_block(root, [256, 0]) != hash_block(root, [0, 1])


def test_slot_mapping_helpers():
    table = [7, 3, 9]
    assert slot_of(table, 0, 4) == 28
    assert slot_of(table, 5, 4) == 13
    assert slot_mapping(table, 2, 10, 4) == [30, 31, 12, 13, 14, 15, 36, 37]
    assert slot_mapping(table, 4, 4, 4) == []
    assert slot_mapping(table, 0, 12, 4) == [slot_of(table, p, 4) for p in range(12)]


def test_tables_grow_on_demand_and_cover_exactly():
    kv = make()
    r = add(kv, "a", range(10))
    admit(kv, r, num_new=6)  # a first chunk of 6 tokens: 2 blocks
    assert [len(t) for t in kv.block_tables("a")] == [2]
    assert kv.num_allocated_tokens("a") == 6
    step(kv, r, 6)
    assert kv.allocate_slots(r, 4)  # the rest of the prompt: 10 tokens, 3 blocks
    assert len(kv.block_tables("a")[0]) == 3
    step(kv, r, 4, sample=50)
    for i in range(2):  # decodes fill block 3 (positions 10, 11) without a new block
        assert kv.allocate_slots(r, 1)
        assert len(kv.block_tables("a")[0]) == 3
        step(kv, r, 1, sample=51 + i)
    assert kv.allocate_slots(r, 1)  # position 12 opens block 4
    assert len(kv.block_tables("a")[0]) == 4
    assert kv.num_used_blocks == 4
    kv.remove("a")
    assert kv.num_free_blocks == kv.num_usable_blocks == 19
    kv.remove("a")  # idempotent


def test_allocation_is_all_or_nothing():
    kv = make(num_blocks=4)  # 3 usable
    r = add(kv, "a", range(20))
    hit, tables = kv.get_computed_blocks(r)
    assert not kv.admit(r, hit, tables, 16)  # 4 blocks needed
    assert kv.num_free_blocks == 3 and kv.block_tables("a") == [[]]
    assert kv.admit(r, 0, None, 12)
    r.num_computed_tokens = 12
    assert not kv.allocate_slots(r, 1)
    assert len(kv.block_tables("a")[0]) == 3 and kv.num_allocated_tokens("a") == 12


def test_prefix_hit_reuses_full_blocks_and_leaves_the_last_token():
    kv = make()
    a = add(kv, "a", range(11))
    assert admit(kv, a) == 0
    step(kv, a, 11, sample=99)
    a_blocks = list(kv.block_tables("a")[0])

    b = add(kv, "b", list(range(8)) + [42, 43])  # shares blocks 0 and 1
    assert admit(kv, b) == 8
    assert kv.block_tables("b")[0][:2] == a_blocks[:2]
    assert kv.pool.ref_cnt[a_blocks[0]] == 2

    # A prompt of exactly two full blocks reuses only the first: the last token is computed.
    c = add(kv, "c", range(8))
    assert admit(kv, c) == 4
    assert kv.prefix_queries == 11 + 10 + 8 and kv.prefix_hits == 8 + 4

    # A different salt never hits.
    d = add(kv, "d", range(11), salt="other")
    assert admit(kv, d) == 0


def test_freed_blocks_are_revived_until_reused():
    kv = make(num_blocks=6)  # 5 usable
    a = add(kv, "a", range(9))
    admit(kv, a)
    step(kv, a, 9, sample=1)
    kv.remove("a")
    assert kv.num_free_blocks == 5
    b = add(kv, "b", range(9))
    assert admit(kv, b) == 8  # both full blocks revived from the free queue
    assert kv.num_free_blocks == 2
    kv.remove("b")
    # A big unrelated request takes every free block: the cached prefix is evicted.
    c = add(kv, "c", [100 + i for i in range(20)])
    admit(kv, c)
    kv.remove("c")
    d = add(kv, "d", range(9))
    assert admit(kv, d) == 0


def test_concurrent_identical_prompts_keep_one_cached_copy():
    kv = make()
    a, b = add(kv, "a", range(9)), add(kv, "b", range(9))
    admit(kv, a)
    admit(kv, b)  # nothing cached yet: computes its own copy
    step(kv, a, 9, 1)
    step(kv, b, 9, 1)
    ta, tb = kv.block_tables("a")[0], kv.block_tables("b")[0]
    assert ta[0] != tb[0]
    assert kv.pool.lookup(0, kv._reqs["a"].hashes[0]) == ta[0]
    assert kv.pool.block_hash[tb[0]] is None


def test_prefix_caching_off():
    kv = make(caching=False)
    a = add(kv, "a", range(9))
    admit(kv, a)
    step(kv, a, 9, 1)
    b = add(kv, "b", range(9))
    assert admit(kv, b) == 0
    assert kv.prefix_queries == 0 and not kv._reqs["a"].hashes


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    kv = make()
    parent = add(kv, "p", range(6))  # 1 full block + a partial one
    admit(kv, parent)
    step(kv, parent, 6, sample=7)
    child = Request("c", parent.prompt_token_ids, 8, output_token_ids=[8])
    child.num_computed_tokens = 6
    kv.fork("p", child)
    full, partial = kv.block_tables("p")[0]
    assert kv.block_tables("c")[0] == [full, partial]
    assert kv.pool.ref_cnt[full] == 2 and kv.pool.ref_cnt[partial] == 2

    # The child writes position 6 into the shared partial block: it gets its own copy.
    assert kv.allocate_slots(child, 1)
    new = kv.block_tables("c")[0][1]
    assert new not in (full, partial)
    assert kv.take_copies() == [(partial, new)]
    assert kv.take_copies() == []
    assert kv.pool.ref_cnt[partial] == 1
    # The parent now owns its partial block alone and writes in place.
    assert kv.allocate_slots(parent, 1)
    assert kv.block_tables("p")[0] == [full, partial]
    assert kv.take_copies() == []
    kv.remove("p")
    kv.remove("c")
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_fork_on_a_block_boundary_needs_no_copy():
    kv = make()
    parent = add(kv, "p", range(8))
    admit(kv, parent)
    step(kv, parent, 8, sample=7)
    child = Request("c", parent.prompt_token_ids, 8, output_token_ids=[8])
    child.num_computed_tokens = 8
    kv.fork("p", child)
    assert kv.allocate_slots(child, 1) and kv.allocate_slots(parent, 1)
    assert kv.take_copies() == []
    assert kv.block_tables("c")[0][:2] == kv.block_tables("p")[0][:2]
    assert kv.block_tables("c")[0][2] != kv.block_tables("p")[0][2]


def test_preempted_copy_is_dropped():
    kv = make()
    parent = add(kv, "p", range(6))
    admit(kv, parent)
    step(kv, parent, 6, sample=7)
    child = Request("c", parent.prompt_token_ids, 8, output_token_ids=[8])
    child.num_computed_tokens = 6
    kv.fork("p", child)
    assert kv.allocate_slots(child, 1)
    kv.free("c")  # preempted in the same step: its copy must not run
    assert kv.take_copies() == []


def test_sliding_window_releases_blocks_out_of_the_window():
    # W = 6, block size 4: a query at p reads p-5..p.
    kv = make(groups=(FULL, KVCacheGroupSpec(sliding_window=6)))
    r = add(kv, "a", range(30))
    admit(kv, r, num_new=9)
    step(kv, r, 9)
    # Next query at 9 reads 4..9: block 0 (0..3) is dead, block 1 (4..7) is not.
    assert kv.allocate_slots(r, 1)
    full, window = kv.block_tables("a")
    assert len(full) == len(window) == 3
    assert window[0] == NULL_BLOCK_ID and full[0] != NULL_BLOCK_ID
    assert window[1] != NULL_BLOCK_ID
    step(kv, r, 1)
    assert kv.allocate_slots(r, 1)  # query at 10 reads 5..10: block 1 still needed
    assert kv.block_tables("a")[1][1] != NULL_BLOCK_ID
    step(kv, r, 1)
    step(kv, r, 1)  # 12 computed: query at 12 reads 7..12
    assert kv.allocate_slots(r, 1)
    assert kv.block_tables("a")[1][1] != NULL_BLOCK_ID
    step(kv, r, 1)  # query at 13 reads 8..13: block 1 (4..7) is dead
    assert kv.allocate_slots(r, 1)
    assert kv.block_tables("a")[1][:2] == [NULL_BLOCK_ID, NULL_BLOCK_ID]
    assert kv.num_used_blocks == 4 + 2
    kv.remove("a")
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_sliding_prefix_hit_needs_only_the_window():
    kv = make(num_blocks=40, groups=(KVCacheGroupSpec(sliding_window=5),))
    prompt = list(range(21))
    a = add(kv, "a", prompt)
    admit(kv, a, num_new=8)
    step(kv, a, 8)
    for _ in range(3):
        assert kv.allocate_slots(a, 4)
        step(kv, a, 4)
    assert kv.allocate_slots(a, 1)
    step(kv, a, 1, sample=3)
    # Blocks 0..2 are dead for a but stay cached; everything is findable.
    kv.remove("a")
    b = add(kv, "b", prompt + [5, 6])
    hit = admit(kv, b)
    assert hit == 20  # 22 tokens -> at most 5 blocks
    # Only blocks covering positions 16..19 (what a query at 20 reads) are held.
    assert kv.block_tables("b")[0][:4] == [NULL_BLOCK_ID] * 4
    assert kv.block_tables("b")[0][4] != NULL_BLOCK_ID


def test_hybrid_hit_is_valid_for_every_group():
    # Full attention needs every block; the sliding group only the last ones. If the sliding
    # group lost the blocks near the end of the prefix, the hit shrinks to where both agree.
    groups = (FULL, KVCacheGroupSpec(sliding_window=3))
    kv = make(num_blocks=40, groups=groups)
    a = add(kv, "a", range(17))
    admit(kv, a)
    step(kv, a, 17, sample=1)
    full = kv.block_tables("a")[0]
    window = kv.block_tables("a")[1]
    # Evict the sliding group's block 3 (positions 12..15) by hand.
    kv.pool._evict(window[3])
    kv.remove("a")
    b = add(kv, "b", range(17))
    hit = admit(kv, b)
    # 16 would need sliding block 3; 12 needs block 2 (positions 10..11) -> fine.
    assert hit == 12
    assert kv.block_tables("b")[0][:3] == full[:3]
    assert kv.block_tables("b")[1][:3] == [NULL_BLOCK_ID, NULL_BLOCK_ID, window[2]]


def test_max_blocks_needed():
    kv = make(groups=(FULL, KVCacheGroupSpec(sliding_window=8)))
    # full: 25 tokens -> 7 blocks; sliding: 7 old + one 4-token chunk = 11 -> 3 + 1.
    assert kv.max_blocks_needed(25, max_chunk=4) == 7 + 4
    assert kv.max_blocks_needed(3, max_chunk=4) == 1 + 1


def test_waste_counts_partial_last_blocks_once():
    kv = make()
    a = add(kv, "a", range(6))
    admit(kv, a)
    step(kv, a, 6, sample=1)
    assert kv.waste_slots() == (2, 8)
    child = Request("c", a.prompt_token_ids, 8, output_token_ids=[2])
    child.num_computed_tokens = 6
    kv.fork("a", child)
    assert kv.waste_slots() == (2, 8)  # the shared partial block counts once
    assert kv.usage == pytest.approx(2 / 19)
