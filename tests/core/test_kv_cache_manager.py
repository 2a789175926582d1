"""KVCacheManager through its public API: allocation, LRU eviction, prefix hits, limits.

Each test ends with ``assert_no_leaks``: with every request freed, all usable
blocks are free, every reference count is zero and the prefix cache can reset.
"""

from __future__ import annotations

import pytest

from tokenloom.core.kv_cache import EMPTY_BLOCKS, KVCacheBlocks, KVCacheManager, hashing
from tokenloom.request import Request
from tokenloom.sampling_params import SamplingParams

BS = 4


def make_manager(
    num_blocks: int = 11, max_model_len: int = 64, enable_caching: bool = True
) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, max_model_len, enable_caching=enable_caching)


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=None))


def schedule(
    manager: KVCacheManager, request: Request, num_new: int | None = None, lookahead: int = 0
) -> KVCacheBlocks | None:
    """What the scheduler does: prefix lookup for a request holding no blocks, then allocate."""
    computed: KVCacheBlocks | None = None
    num_hit = 0
    if not manager.get_block_ids(request.request_id):
        computed, num_hit = manager.get_computed_blocks(request)
    if num_new is None:
        num_new = request.num_tokens - request.num_computed_tokens - num_hit
    new = manager.allocate_slots(request, num_new, num_hit, computed, lookahead)
    if new is not None:
        request.num_computed_tokens += num_hit + num_new
    return new


def decode(manager: KVCacheManager, request: Request, token: int) -> KVCacheBlocks | None:
    request.append_output_token_ids([token], manager.max_model_len)
    return schedule(manager, request, 1)


def hit_ids(manager: KVCacheManager, request: Request) -> list[int]:
    blocks, num_tokens = manager.get_computed_blocks(request)
    assert num_tokens == BS * len(blocks.get_block_ids())
    return blocks.get_block_ids()


def snapshot(manager: KVCacheManager, requests: list[Request]) -> tuple:
    pool = manager.block_pool
    return (
        {r.request_id: manager.get_block_ids(r.request_id) for r in requests},
        [block.block_id for block in pool.free_queue],
        [block.ref_cnt for block in pool.blocks],
        sorted(block.block_id for block in pool.cached.values()),
        manager.usage,
        manager.num_free_blocks,
    )


def assert_no_leaks(manager: KVCacheManager, requests: list[Request]) -> None:
    for request in requests:
        manager.free(request)
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_blocks - 1
    assert manager.usage == 0.0
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
    assert manager.reset_prefix_cache()
    manager.check_integrity()
    assert not manager.block_pool.cached


def test_constructor_validates_arguments() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(1, BS, 64)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(8, 0, 64)
    with pytest.raises(ValueError, match="max_model_len"):
        KVCacheManager(8, BS, 0)


def test_allocation_uses_usable_blocks_and_grows_only_when_full() -> None:
    m = make_manager()
    a = make_request("a", list(range(10)))
    new = schedule(m, a)
    assert new is not None
    ids = new.get_block_ids()
    assert len(ids) == 3 and 0 not in ids and len(set(ids)) == 3
    assert m.get_block_ids("a") == ids
    assert m.usage == pytest.approx(3 / 10)
    assert m.num_free_blocks == 7
    # Tokens 11 and 12 fit the third block: the shared empty result, nothing allocated.
    assert decode(m, a, 100) is EMPTY_BLOCKS
    assert decode(m, a, 101) is EMPTY_BLOCKS
    assert m.get_block_ids("a") == ids
    grown = decode(m, a, 102)
    assert grown is not None and len(grown.get_block_ids()) == 1
    assert m.get_block_ids("a") == ids + grown.get_block_ids()
    m.check_integrity()
    assert m.get_block_ids("unknown") == []
    assert_no_leaks(m, [a])


def test_usage_excludes_null_block() -> None:
    m = make_manager(num_blocks=5)
    a = make_request("a", list(range(16)))
    assert schedule(m, a) is not None
    assert m.usage == 1.0 and m.num_free_blocks == 0
    assert 0 not in m.get_block_ids("a")
    assert schedule(m, make_request("b", [1])) is None
    assert_no_leaks(m, [a])


def test_prefix_hit_shares_blocks_and_counts_references() -> None:
    m = make_manager()
    a = make_request("a", list(range(10)))
    schedule(m, a)
    b = make_request("b", list(range(8)) + [99, 98, 97])
    assert hit_ids(m, b) == m.get_block_ids("a")[:2]
    new = schedule(m, b)
    assert new is not None and len(new.get_block_ids()) == 1
    assert b.num_computed_tokens == 11
    shared = m.get_block_ids("a")[:2]
    assert m.get_block_ids("b")[:2] == shared
    assert [m.block_pool.blocks[i].ref_cnt for i in shared] == [2, 2]
    assert m.get_num_common_prefix_blocks("b") == 2
    m.free(a)
    assert [m.block_pool.blocks[i].ref_cnt for i in shared] == [1, 1]
    assert m.num_free_blocks == 10 - 3
    m.check_integrity()
    assert_no_leaks(m, [b])


def test_get_computed_blocks_has_no_side_effects() -> None:
    m = make_manager()
    a = make_request("a", list(range(12)))
    c = make_request("c", [50, 51, 52, 53, 54])
    schedule(m, a)
    schedule(m, c)
    m.free(a)  # a's cached blocks now sit in the free queue
    b = make_request("b", list(range(12)) + [7])
    before = snapshot(m, [a, b, c])
    assert len(hit_ids(m, b)) == 3
    assert len(hit_ids(m, b)) == 3
    assert snapshot(m, [a, b, c]) == before
    assert_no_leaks(m, [c])


def test_hit_after_owner_freed_then_miss_after_eviction() -> None:
    m = make_manager(num_blocks=5)
    a = make_request("a", list(range(9)))
    schedule(m, a)
    a_ids = m.get_block_ids("a")
    m.free(a)
    # Cached-but-free blocks count as free: they are evictable.
    assert m.num_free_blocks == 4 and len(m.block_pool.cached) == 2 and m.usage == 0.0
    b = make_request("b", list(range(9)))
    assert hit_ids(m, b) == a_ids[:2]
    schedule(m, b)
    assert m.get_block_ids("b")[:2] == a_ids[:2]
    m.free(b)
    c = make_request("c", list(range(100, 116)))  # takes all 4 usable blocks
    assert schedule(m, c) is not None
    m.free(c)
    assert hit_ids(m, make_request("d", list(range(9)))) == []
    assert_no_leaks(m, [])


def test_lru_evicts_tail_blocks_and_least_recently_freed_first() -> None:
    m = make_manager(num_blocks=9)  # 8 usable blocks
    a = make_request("a", list(range(12)))
    b = make_request("b", list(range(20, 32)))
    schedule(m, a)
    schedule(m, b)
    a_ids, b_ids = m.get_block_ids("a"), m.get_block_ids("b")
    m.free(a)
    m.free(b)
    # Never-used blocks first, then a's blocks tail first, then b's.
    order = [block.block_id for block in m.block_pool.free_queue]
    assert order[2:] == a_ids[::-1] + b_ids[::-1]
    c = make_request("c", list(range(40, 52)))
    schedule(m, c)
    assert m.get_block_ids("c")[2] == a_ids[2]  # a's tail block was evicted first
    a_again = make_request("a2", list(range(12)) + [0])
    b_again = make_request("b2", list(range(20, 32)) + [0])
    assert hit_ids(m, a_again) == a_ids[:2]
    assert hit_ids(m, b_again) == b_ids
    d = make_request("d", list(range(60, 68)))
    schedule(m, d)
    assert m.get_block_ids("d") == [a_ids[1], a_ids[0]]
    assert hit_ids(m, a_again) == []
    assert hit_ids(m, b_again) == b_ids
    assert_no_leaks(m, [c, d])


def test_hit_never_covers_the_last_prompt_token() -> None:
    m = make_manager()
    a = make_request("a", list(range(8)))
    schedule(m, a)
    assert len(m.block_pool.cached) == 2
    exact = make_request("b", list(range(8)))
    assert hit_ids(m, exact) == m.get_block_ids("a")[:1]  # (8 - 1) // 4 = 1 block
    longer = make_request("c", list(range(8)) + [5])
    assert hit_ids(m, longer) == m.get_block_ids("a")
    assert hit_ids(m, make_request("d", list(range(4)))) == []
    new = schedule(m, exact)
    assert new is not None and exact.num_computed_tokens == 8
    assert m.get_block_ids("b")[0] == m.get_block_ids("a")[0]
    assert_no_leaks(m, [a, exact])


def test_digest_collisions_never_give_a_wrong_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "digest_block", lambda parent, tokens: 1234)
    m = make_manager()
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    schedule(m, a)
    # Same second block, different first block: every digest is equal, still no hit.
    b = make_request("b", [11, 12, 13, 14, 5, 6, 7, 8, 9])
    assert hit_ids(m, b) == []
    assert hit_ids(m, make_request("x", [1, 2, 3, 4, 5, 6, 7, 0, 9])) == m.get_block_ids("a")[:1]
    schedule(m, b)
    assert len(m.block_pool.cached) == 4  # colliding entries live side by side
    a_ids, b_ids = m.get_block_ids("a"), m.get_block_ids("b")
    m.free(a)
    m.free(b)
    c = make_request("c", [11, 12, 13, 14, 5, 6, 7, 8, 0])
    d = make_request("d", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert hit_ids(m, c) == b_ids[:2]
    assert hit_ids(m, d) == a_ids[:2]
    assert_no_leaks(m, [])


def test_lookahead_slots_are_allocated_but_not_cached() -> None:
    m = make_manager()
    a = make_request("a", list(range(4)))
    new = schedule(m, a, lookahead=4)
    assert new is not None and len(new.get_block_ids()) == 2
    assert len(m.block_pool.cached) == 1
    # The lookahead block is reused for the next tokens without a new allocation.
    assert decode(m, a, 9) is EMPTY_BLOCKS
    assert_no_leaks(m, [a])


def test_slots_are_capped_at_max_model_len() -> None:
    m = make_manager(max_model_len=8)
    a = make_request("a", list(range(6)))
    new = schedule(m, a, lookahead=10)
    assert new is not None and len(m.get_block_ids("a")) == 2
    assert_no_leaks(m, [a])


def test_exhaustion_returns_none_and_changes_nothing() -> None:
    m = make_manager(num_blocks=5)  # 4 usable
    a = make_request("a", list(range(8)))
    c = make_request("c", list(range(50, 58)))
    schedule(m, a)
    schedule(m, c)
    a_ids = m.get_block_ids("a")
    m.free(a)  # a's two cached blocks are the only free ones
    d = make_request("d", list(range(8)) + [1])
    computed, num_hit = m.get_computed_blocks(d)
    assert num_hit == 8
    before = snapshot(m, [a, c, d])
    # One new block would fit the 2 free blocks, but touching the 2 hit blocks
    # takes them out of the free queue too.
    assert m.allocate_slots(d, 1, num_hit, computed) is None
    assert snapshot(m, [a, c, d]) == before
    m.check_integrity()
    big = make_request("big", list(range(100, 120)))
    before = snapshot(m, [c, big])
    assert m.allocate_slots(big, 20) is None
    assert snapshot(m, [c, big]) == before
    m.free(c)
    assert schedule(m, d) is not None
    assert m.get_block_ids("d")[:2] == a_ids
    assert_no_leaks(m, [d])


def test_common_prefix_blocks_counts_blocks_held_by_every_request() -> None:
    m = make_manager(num_blocks=20)
    reqs = [make_request(f"r{i}", list(range(8)) + [i, i, i]) for i in range(3)]
    for r in reqs:
        schedule(m, r)
    assert m.get_num_common_prefix_blocks("r0") == 2
    assert m.get_num_common_prefix_blocks("r2") == 2
    other = make_request("other", [9, 9, 9, 9, 9])
    schedule(m, other)
    assert m.get_num_common_prefix_blocks("r0") == 0
    m.free(other)
    assert m.get_num_common_prefix_blocks("r1") == 2
    assert m.get_num_common_prefix_blocks("missing") == 0
    assert_no_leaks(m, reqs)


def test_reset_prefix_cache_refuses_while_blocks_are_in_use() -> None:
    m = make_manager()
    a = make_request("a", list(range(9)))
    schedule(m, a)
    assert not m.reset_prefix_cache()
    assert len(hit_ids(m, make_request("b", list(range(9))))) == 2
    m.free(a)
    assert m.reset_prefix_cache()
    assert hit_ids(m, make_request("c", list(range(9)))) == []
    m.check_integrity()
    assert_no_leaks(m, [])


def test_reset_prefix_cache_hands_blocks_out_in_block_order_again() -> None:
    m = make_manager()
    first = [make_request(name, list(range(i * 100, i * 100 + 9))) for i, name in enumerate("abc")]
    for req in first:
        schedule(m, req)
    for req in reversed(first):  # freed out of order: the LRU queue is no longer in block order
        m.free(req)
    assert [b.block_id for b in m.block_pool.free_queue][:3] != [1, 2, 3]
    assert m.reset_prefix_cache()
    assert [b.block_id for b in m.block_pool.free_queue] == list(range(1, m.num_blocks))
    new = schedule(m, make_request("d", list(range(1000, 1009))))
    assert new is not None and new.get_block_ids() == [1, 2, 3]
    m.check_integrity()


def test_generated_tokens_are_cached_once_their_block_fills() -> None:
    m = make_manager()
    a = make_request("a", list(range(6)))
    schedule(m, a)
    decode(m, a, 70)
    follow = make_request("f", list(range(6)) + [70, 71, 72])
    assert hit_ids(m, follow) == m.get_block_ids("a")[:1]
    decode(m, a, 71)  # fills the second block
    assert hit_ids(m, follow) == m.get_block_ids("a")[:2]
    assert_no_leaks(m, [a])


def test_cache_blocks_is_incremental_and_idempotent() -> None:
    m = make_manager()
    a = make_request("a", list(range(10)))
    schedule(m, a, 4)  # a chunk of one block
    assert len(m.block_pool.cached) == 1
    m.cache_blocks(a, 4)
    m.cache_blocks(a, 100)  # beyond what a holds: capped at its full blocks
    assert len(m.block_pool.cached) == 1
    schedule(m, a, 6)
    m.cache_blocks(a, 10)
    m.cache_blocks(a, 10)
    assert len(m.block_pool.cached) == 2
    m.cache_blocks(make_request("none", [1]), 1)  # unknown request: ignored
    m.check_integrity()
    assert_no_leaks(m, [a])


def test_caching_disabled_never_hits_and_never_hashes() -> None:
    m = make_manager(enable_caching=False)
    a = make_request("a", list(range(9)))
    schedule(m, a)
    b = make_request("b", list(range(9)))
    assert m.get_computed_blocks(b) == (EMPTY_BLOCKS, 0)
    assert not m.block_pool.cached and a.block_hashes == []
    m.cache_blocks(a, 9)
    assert not m.block_pool.cached
    assert_no_leaks(m, [a])


def test_preempted_request_hits_its_own_blocks_again() -> None:
    m = make_manager()
    a = make_request("a", list(range(10)))
    schedule(m, a)
    decode(m, a, 1)
    decode(m, a, 2)
    ids = m.get_block_ids("a")
    m.free(a)
    a.num_computed_tokens = 0
    assert hit_ids(m, a) == ids[:2]  # (12 - 1) // 4 full blocks
    schedule(m, a)
    assert m.get_block_ids("a") == ids[:2] + m.get_block_ids("a")[2:]
    assert a.num_computed_tokens == 12
    assert_no_leaks(m, [a])


def test_stale_or_inconsistent_computed_blocks_are_rejected() -> None:
    m = make_manager(num_blocks=5)
    a = make_request("a", list(range(9)))
    schedule(m, a)
    m.free(a)
    b = make_request("b", list(range(9)))
    computed, num_hit = m.get_computed_blocks(b)
    filler = make_request("filler", list(range(100, 116)))
    schedule(m, filler)  # evicts the blocks b was told about
    m.free(filler)
    with pytest.raises(ValueError, match="not a current prefix hit"):
        m.allocate_slots(b, 1, num_hit, computed)
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        m.allocate_slots(b, 1, 3, EMPTY_BLOCKS)
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate_slots(b, -1)
    m.check_integrity()
    assert_no_leaks(m, [b])


def test_check_integrity_reports_corruption() -> None:
    m = make_manager()
    a = make_request("a", list(range(9)))
    schedule(m, a)
    block = m.block_pool.blocks[m.get_block_ids("a")[0]]
    block.ref_cnt += 1
    with pytest.raises(RuntimeError, match="ref_cnt"):
        m.check_integrity()
    block.ref_cnt -= 1
    m.check_integrity()
    assert_no_leaks(m, [a])


def test_blocks_container() -> None:
    m = make_manager()
    a = make_request("a", list(range(9)))
    new = schedule(m, a)
    assert new is not None
    assert (EMPTY_BLOCKS + new).get_block_ids() == new.get_block_ids()
    assert (new + new).get_block_ids() == new.get_block_ids() * 2
    assert m.create_empty_block_list().get_block_ids() == []
    assert bool(EMPTY_BLOCKS)  # never falsy: callers test for None
    assert_no_leaks(m, [a])


@pytest.mark.parametrize("enable_caching", [True, False])
def test_next_allocation_at_bounds_the_no_op_path_exactly(enable_caching: bool) -> None:
    """The scheduler skips allocate_slots below ``next_allocation_at(request_id)``; that
    must be a no-op, and reaching the bound must not be (a block is added or filled)."""
    manager = make_manager(num_blocks=20, enable_caching=enable_caching)
    other = make_request("other", [9] * 6)
    schedule(manager, other)
    request = make_request("r", [1, 2, 3, 4, 5])
    with pytest.raises(KeyError):
        manager.next_allocation_at("r")  # holds no blocks yet
    schedule(manager, request)
    crossings = 0
    for token in range(20):
        request.append_output_token_ids([token], manager.max_model_len)
        before = snapshot(manager, [request, other])
        end = request.num_computed_tokens + 1
        if end < manager.next_allocation_at("r"):
            assert manager.allocate_slots(request, 1) is EMPTY_BLOCKS
            assert snapshot(manager, [request, other]) == before
        else:
            assert end == manager.next_allocation_at("r")  # tight: one token crosses it
            crossings += 1
            cached_before = manager.block_pool.cached.copy()
            new = manager.allocate_slots(request, 1)
            assert new is not None
            changed = new.blocks or manager.block_pool.cached != cached_before
            assert changed
        request.num_computed_tokens = end
        manager.check_integrity()  # the bound stays in step with the blocks
    # Computed ends 6..25 with blocks of 4: a new block at 9, 13, .., 25; with caching
    # also a block filled (and cached) at 8, 12, .., 24.
    assert crossings == (10 if enable_caching else 5)
    manager.free(request)
    with pytest.raises(KeyError):
        manager.next_allocation_at("r")
    assert_no_leaks(manager, [other])
