"""Scheduling decisions: budgets, admission order, chunking, prefix hits, preemption.

Every test drives a real Scheduler and KVCacheManager with the fake runner of
tests/core/utils.py and ends with the leak check.
"""

from __future__ import annotations

import pytest

from tests.core.utils import (
    Harness,
    assert_no_leaks,
    make_request,
    make_scheduler,
)
from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.core.sched.scheduler import Scheduler
from tokenloom.request import RequestStatus


def test_num_blocks_must_be_set() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        Scheduler(SchedulerConfig(), CacheConfig(num_blocks=None), max_model_len=128)


def test_token_budget_is_shared_and_chunks_the_last_prompt() -> None:
    h = Harness(make_scheduler(max_num_batched_tokens=16))
    h.add(make_request("a", 10), make_request("b", 10), make_request("c", 10))
    so = h.step()
    assert so.num_scheduled_tokens == {"a": 10, "b": 6}
    assert so.total_num_scheduled_tokens == 16
    assert [r.request_id for r in h.scheduler.waiting] == ["c"]
    # b's prefill continues; a decodes first (running order), c gets the rest.
    so = h.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 4, "c": 10}
    h.run_until_done()
    assert all(len(h.tokens(r)) == 16 for r in "abc")
    assert_no_leaks(h.scheduler)


def test_max_num_seqs_limits_running_requests() -> None:
    h = Harness(make_scheduler(max_num_seqs=2))
    h.add(*(make_request(str(i), 5, max_tokens=3) for i in range(5)))
    so = h.step()
    assert list(so.num_scheduled_tokens) == ["0", "1"]
    assert h.scheduler.get_request_counts() == (2, 3)
    while h.scheduler.has_requests():
        so = h.step()
        assert len(so.num_scheduled_tokens) <= 2
    assert sorted(h.finished) == ["0", "1", "2", "3", "4"]
    assert_no_leaks(h.scheduler)


def test_running_requests_are_served_before_waiting_ones() -> None:
    h = Harness(make_scheduler(max_num_batched_tokens=8))
    h.add(make_request("a", 6, max_tokens=4))
    h.step()
    h.add(make_request("b", 30, max_tokens=2))
    so = h.step()
    # a decodes (1 token) before b's prompt takes what is left of the budget.
    assert so.num_scheduled_tokens == {"a": 1, "b": 7}
    assert so.scheduled_cached_reqs.req_ids == ["a"]
    assert [n.req_id for n in so.scheduled_new_reqs] == ["b"]
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_chunked_prefill_advances_num_computed_at_schedule_time() -> None:
    h = Harness(make_scheduler(max_num_batched_tokens=16))
    request = make_request("a", 50, max_tokens=2)
    h.add(request)
    chunks, starts = [], []
    for _ in range(4):
        so = h.schedule()
        chunks.append(so.num_scheduled_tokens["a"])
        if so.scheduled_new_reqs:
            starts.append(so.scheduled_new_reqs[0].num_computed_tokens)
        else:
            starts.append(so.scheduled_cached_reqs.num_computed_tokens[0])
        assert request.num_computed_tokens == starts[-1] + chunks[-1]
        h.run(so)
    assert chunks == [16, 16, 16, 2]
    assert starts == [0, 16, 32, 48]
    # Only the step finishing the prompt produced a token.
    assert len(h.outputs["a"]) == 1 and request.num_output_tokens == 1
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_long_prefill_token_threshold_caps_chunks_not_decodes() -> None:
    h = Harness(make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8))
    h.add(make_request("a", 20, max_tokens=3), make_request("b", 4, max_tokens=3))
    so = h.step()
    assert so.num_scheduled_tokens == {"a": 8, "b": 4}
    so = h.step()
    assert so.num_scheduled_tokens == {"a": 8, "b": 1}
    so = h.step()
    assert so.num_scheduled_tokens == {"a": 4, "b": 1}
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_chunking_off_waits_without_reordering_under_fcfs() -> None:
    h = Harness(make_scheduler(max_num_batched_tokens=32, enable_chunked_prefill=False))
    h.add(make_request("a", 20, max_tokens=5))
    h.add(make_request("b", 30, max_tokens=2))
    h.add(make_request("c", 4, max_tokens=2))
    so = h.step()
    # b does not fit next to a; c would, but may not overtake b.
    assert so.num_scheduled_tokens == {"a": 20}
    so = h.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 30}
    assert [r.request_id for r in h.scheduler.waiting] == ["c"]
    h.run_until_done()
    assert sorted(h.finished) == ["a", "b", "c"]
    assert_no_leaks(h.scheduler)


def test_priority_policy_admits_in_priority_then_arrival_order() -> None:
    h = Harness(make_scheduler(policy="priority", max_num_seqs=2))
    h.add(make_request("low", 4, priority=5, arrival_time=1.0, max_tokens=2))
    h.add(make_request("high_late", 4, priority=0, arrival_time=3.0, max_tokens=2))
    h.add(make_request("high_early", 4, priority=0, arrival_time=2.0, max_tokens=2))
    h.add(make_request("mid", 4, priority=1, arrival_time=0.5, max_tokens=2))
    assert [r.request_id for r in h.scheduler.waiting] == ["high_early", "high_late", "mid", "low"]
    so = h.step()
    assert [n.req_id for n in so.scheduled_new_reqs] == ["high_early", "high_late"]
    assert [r.request_id for r in h.scheduler.running] == ["high_early", "high_late"]
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_prefix_hit_sets_num_cached_tokens_and_recomputes_last_token() -> None:
    h = Harness(make_scheduler(block_size=4))
    prompt = list(range(100, 116))  # exactly 4 full blocks
    h.add(make_request("first", prompt, max_tokens=2))
    h.step()
    h.add(make_request("same", prompt, max_tokens=2))
    h.add(make_request("longer", prompt + [7], max_tokens=2))
    h.add(make_request("diverges", prompt[:6] + [1] * 10, max_tokens=2))
    so = h.schedule()
    new = {n.req_id: n for n in so.scheduled_new_reqs}
    # A full hit still recomputes the last prompt token: 3 blocks hit, 4 tokens run.
    assert new["same"].num_computed_tokens == 12
    assert so.num_scheduled_tokens["same"] == 4
    assert new["longer"].num_computed_tokens == 16
    assert so.num_scheduled_tokens["longer"] == 1
    assert new["diverges"].num_computed_tokens == 4
    first_blocks = h.scheduler.kv_cache_manager.get_block_ids("first")
    assert new["longer"].block_ids[:4] == first_blocks[:4]
    assert new["same"].block_ids[:3] == first_blocks[:3]
    h.run(so)
    requests = h.scheduler.requests
    assert requests["same"].num_cached_tokens == 12
    assert h.outputs["same"][0].num_cached_tokens == 12
    assert h.outputs["longer"][0].num_cached_tokens == 16
    h.run_until_done()
    assert h.finished["first"].num_cached_tokens == 0
    assert_no_leaks(h.scheduler)


def test_prefix_caching_off_never_hits() -> None:
    h = Harness(make_scheduler(enable_prefix_caching=False, log_stats=True))
    prompt = list(range(16))
    h.add(make_request("a", prompt, max_tokens=1))
    h.step()
    h.add(make_request("b", prompt, max_tokens=1))
    so = h.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert so.num_scheduled_tokens == {"b": 16}
    h.run_until_done()
    assert h.finished["b"].num_cached_tokens == 0
    assert_no_leaks(h.scheduler)


def test_num_common_prefix_blocks_only_when_every_running_request_is_scheduled() -> None:
    h = Harness(make_scheduler(block_size=4, max_num_batched_tokens=64))
    shared = list(range(500, 508))  # 2 blocks
    for i in range(3):
        h.add(make_request(f"r{i}", shared + [i] * 5, max_tokens=20))
    so = h.step()
    assert so.num_common_prefix_blocks == 2
    so = h.step()
    assert so.num_common_prefix_blocks == 2
    # A new request that shares nothing joins: common prefix drops to 0.
    h.add(make_request("other", [9] * 6, max_tokens=2))
    so = h.step()
    assert so.num_common_prefix_blocks == 0
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_common_prefix_is_zero_when_a_running_request_is_left_out() -> None:
    h = Harness(make_scheduler(block_size=4, max_num_batched_tokens=3))
    shared = list(range(500, 508))
    for i in range(3):
        h.add(make_request(f"r{i}", shared + [i], max_tokens=20))
    for _ in range(12):
        so = h.step()
        if len(h.scheduler.running) == 3:
            break
    # All three decode in one step (budget 3): common prefix reported.
    so = h.step()
    assert len(so.num_scheduled_tokens) == 3 and so.num_common_prefix_blocks == 2
    h.scheduler.update_draft_token_ids({"r0": [1, 2]})
    so = h.step()  # r0 takes 3 tokens: r1, r2 left out
    assert list(so.num_scheduled_tokens) == ["r0"] and so.num_common_prefix_blocks == 0
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_finished_ids_are_flushed_into_the_next_step_only() -> None:
    h = Harness(make_scheduler())
    h.add(make_request("a", 4, max_tokens=1), make_request("b", 4, max_tokens=3))
    so = h.step()
    assert so.finished_req_ids == set()
    assert "a" in h.finished and "a" not in h.scheduler.requests
    assert h.scheduler.has_finished_requests()
    so = h.step()
    assert so.finished_req_ids == {"a"}
    assert not h.scheduler.has_finished_requests()
    so = h.step()
    assert so.finished_req_ids == set()
    so = h.step()
    assert so.finished_req_ids == {"b"} and so.num_scheduled_tokens == {}
    assert not h.scheduler.has_requests()
    assert_no_leaks(h.scheduler)


# ----------------------------------------------------------------- preemption


def test_fcfs_preempts_the_last_running_request_and_admits_nothing() -> None:
    # 7 usable blocks of 4 tokens; three 7-token prompts take 2 blocks each.
    h = Harness(make_scheduler(block_size=4, num_blocks=8))
    h.add(*(make_request(r, 7, max_tokens=12) for r in "abc"))
    h.step()  # prefill: 6 blocks used, 1 free
    h.step()  # position 7 still fits the second block
    h.add(make_request("d", 2, max_tokens=2))  # would fit in the blocks c frees
    so = h.schedule()  # position 8: a takes the free block, b must preempt c
    assert so.preempted_req_ids == {"c"}
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert so.scheduled_new_reqs == []  # d is not admitted in a preempting step
    assert [r.request_id for r in h.scheduler.running] == ["a", "b"]
    c = h.scheduler.requests["c"]
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert h.scheduler.kv_cache_manager.get_block_ids("c") == []
    assert [r.request_id for r in h.scheduler.waiting] == ["c", "d"]
    h.run(so)
    h.run_until_done()
    assert sorted(h.finished) == ["a", "b", "c", "d"]
    assert [len(h.tokens(r)) for r in "abcd"] == [12, 12, 12, 2]
    assert_no_leaks(h.scheduler)


def test_victim_being_scheduled_stops_the_running_pass() -> None:
    # 4 usable blocks of 4 tokens, all held: a (6-token prompt) still has a free
    # slot when b (7 tokens) needs a new block, and b is the last running request.
    h = Harness(make_scheduler(block_size=4, num_blocks=5))
    h.add(make_request("a", 6, max_tokens=6), make_request("b", 7, max_tokens=6))
    h.step()
    h.step()
    so = h.schedule()
    assert so.preempted_req_ids == {"b"} and so.num_scheduled_tokens == {"a": 1}
    assert h.scheduler.requests["b"].status == RequestStatus.PREEMPTED
    h.run(so)
    h.run_until_done()
    assert [len(h.tokens(r)) for r in "ab"] == [6, 6]
    assert_no_leaks(h.scheduler)


def test_preempting_step_admits_no_waiting_request() -> None:
    # 4 usable blocks of 4 tokens; a and b hold 2 blocks each after their prompts.
    h = Harness(make_scheduler(block_size=4, num_blocks=5))
    h.add(make_request("a", 7, max_tokens=8), make_request("b", 7, max_tokens=8))
    h.step()  # a: 7 tokens in 2 blocks; b the same
    h.step()  # both decode to 9 tokens: still 2 blocks each
    h.add(make_request("c", 2, max_tokens=1))
    so = h.schedule()  # a needs a 3rd block: b is preempted, its blocks freed
    assert so.preempted_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}
    # c would fit in the block left free, but a preempting step admits nobody.
    assert h.scheduler.kv_cache_manager.num_free_blocks >= 1
    assert so.scheduled_new_reqs == []
    assert [r.request_id for r in h.scheduler.waiting] == ["b", "c"]
    h.run(so)
    h.run_until_done()
    assert [len(h.tokens(r)) for r in "abc"] == [8, 8, 1]
    assert_no_leaks(h.scheduler)


def test_priority_preempts_the_lowest_priority_even_if_scheduled_earlier() -> None:
    # 6 usable blocks of 4 tokens, all held after step 2.
    h = Harness(make_scheduler(policy="priority", block_size=4, num_blocks=7))
    # Admission order: low first (it arrives alone), then the higher ones.
    h.add(make_request("low", 6, priority=9, arrival_time=1.0, max_tokens=8))
    h.step()
    h.add(make_request("high", 8, priority=0, arrival_time=2.0, max_tokens=8))
    h.add(make_request("mid", 8, priority=3, arrival_time=3.0, max_tokens=8))
    h.step()
    assert [r.request_id for r in h.scheduler.running] == ["low", "high", "mid"]
    so = h.schedule()
    # low still had room and was scheduled first; high then needed a block, and
    # low, the lowest priority, was taken out of the step again.
    assert so.preempted_req_ids == {"low"}
    assert so.num_scheduled_tokens == {"high": 1, "mid": 1}
    assert so.scheduled_cached_reqs.req_ids == ["high", "mid"]
    assert so.total_num_scheduled_tokens == 2
    low = h.scheduler.requests["low"]
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert [r.request_id for r in h.scheduler.running] == ["high", "mid"]
    h.run(so)
    h.run_until_done()
    assert all(len(h.tokens(r)) == 8 for r in ("low", "high", "mid"))
    assert_no_leaks(h.scheduler)


def test_resumed_request_carries_outputs_and_whole_block_list() -> None:
    # 4 usable blocks of 4 tokens. a finishes in the step that preempts b.
    h = Harness(make_scheduler(block_size=4, num_blocks=5))
    h.add(make_request("a", 7, max_tokens=3), make_request("b", 7, max_tokens=8))
    h.step()
    h.step()
    so = h.step()  # a takes a 3rd block: b is preempted after 2 outputs
    assert so.preempted_req_ids == {"b"} and "a" in h.finished
    request = h.scheduler.requests["b"]
    outputs_before = list(request.output_token_ids)
    assert outputs_before == h.tokens("b") and len(outputs_before) == 2
    so = h.schedule()
    cached = so.scheduled_cached_reqs
    assert cached.req_ids == ["b"] and cached.resumed_req_ids == {"b"}
    assert so.scheduled_new_reqs == []
    assert cached.new_token_ids[0] == outputs_before
    assert cached.new_block_ids[0] == h.scheduler.kv_cache_manager.get_block_ids("b")
    assert len(cached.new_block_ids[0] or []) == 3
    # b's first block is still cached (its tail block went to a): 4 tokens hit.
    assert cached.num_computed_tokens[0] == 4
    assert so.num_scheduled_tokens["b"] == request.num_tokens - 4 == 5
    assert request.num_cached_tokens == 0  # set at the first schedule only
    h.run(so)
    h.run_until_done()
    assert len(h.tokens("b")) == 8
    assert_no_leaks(h.scheduler)


def test_request_too_big_for_the_cache_alone_is_ignored_after_self_preemption() -> None:
    # 3 usable blocks of 4 tokens = 12 slots; the request grows past them.
    h = Harness(make_scheduler(block_size=4, num_blocks=4, max_model_len=100))
    h.add(make_request("a", 10, max_tokens=10))
    h.run_until_done()
    assert len(h.tokens("a")) == 3
    assert h.finished["a"].new_token_ids == [] and h.finished["a"].finish_reason == "length"
    assert_no_leaks(h.scheduler)
