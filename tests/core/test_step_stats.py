"""What a step ran (batch composition) and the KV block map, read off the scheduler."""

from __future__ import annotations

from tests.core.utils import Harness, assert_no_leaks, make_request, make_scheduler
from tokenloom.core.kv_cache.block_map import kv_block_map
from tokenloom.core.sched.step_stats import StepObserver, batch_composition
from tokenloom.outputs import KV_BLOCK_CACHED, KV_BLOCK_FREE, KV_BLOCK_SHARED, KV_BLOCK_USED


def test_batch_composition_splits_prefill_decode_and_draft_tokens() -> None:
    h = Harness(make_scheduler(max_num_batched_tokens=10, block_size=4, num_blocks=64))
    h.add(make_request("a", 6, max_tokens=5), make_request("b", 9, max_tokens=5))
    first = h.step()  # a: 6 prompt tokens; b: a 4-token chunk
    assert batch_composition(first) == (10, 0, 0)
    second = h.step()  # a decodes; b gets its last 5 prompt tokens
    assert batch_composition(second) == (5, 1, 0)
    third = h.step()
    assert batch_composition(third) == (0, 2, 0)
    # Drafts: the single new token is a decode, the drafts are draft tokens.
    h.scheduler.update_draft_token_ids({"a": [1, 2, 3]})
    fourth = h.schedule()
    assert fourth.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    assert batch_composition(fourth) == (0, 2, 3)
    h.run(fourth)
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_a_new_requests_single_token_is_prefill() -> None:
    h = Harness(make_scheduler(block_size=4))
    h.add(make_request("a", 1, max_tokens=2))
    assert batch_composition(h.step()) == (1, 0, 0)
    assert batch_composition(h.step()) == (0, 1, 0)


def test_block_map_shows_free_used_shared_and_cached_blocks() -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=9)
    h = Harness(scheduler)
    prefix = list(range(100, 108))  # two full blocks
    h.add(make_request("a", prefix + [1, 2], max_tokens=3))
    h.step()
    h.add(make_request("b", prefix + [3], max_tokens=3))
    h.step()
    states = kv_block_map(scheduler.kv_cache_manager.block_pool)
    assert len(states) == 8  # the null block is left out
    assert states.count(KV_BLOCK_SHARED) == 2  # the shared prefix
    assert states.count(KV_BLOCK_USED) == 2  # each request's own last block
    assert states.count(KV_BLOCK_FREE) == 4
    h.run_until_done()
    states = kv_block_map(scheduler.kv_cache_manager.block_pool)
    assert KV_BLOCK_USED not in states and KV_BLOCK_SHARED not in states
    assert states.count(KV_BLOCK_CACHED) >= 2  # the prefix can still be hit
    assert_no_leaks(scheduler)


def test_observer_numbers_steps_and_rations_block_maps() -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=16)
    observer = StepObserver(scheduler.kv_cache_manager, block_map_interval_s=10.0)
    h = Harness(scheduler)
    h.add(make_request("a", 5, max_tokens=2))
    so = h.step()
    stats, block_map = observer.observe(so, 1.0, 1.5)
    assert (stats.index, stats.duration_s, stats.num_reqs) == (0, 0.5, 1)
    assert stats.num_prefill_tokens == 5 and block_map is not None
    stats, block_map = observer.observe(h.step(), 1.5, 2.0)
    assert stats.index == 1 and block_map is None  # the next map is due at 11.5
    _, block_map = observer.observe(h.schedule(), 11.4, 11.5)
    assert block_map is not None
