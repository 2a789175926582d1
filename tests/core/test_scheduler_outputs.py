"""update_from_output and the request lifecycle: stops, drafts, aborts, outputs, stats."""

from __future__ import annotations

import pytest

from tests.core.utils import (
    FakeRunner,
    Harness,
    assert_no_leaks,
    make_request,
    make_scheduler,
    scripted,
)
from tokenloom.outputs import ModelRunnerOutput, TokenLogprobs
from tokenloom.request import FinishReason, RequestStatus

EOS = 2


def _harness(scripts: dict[str, list[int]], **kwargs: object) -> Harness:
    return Harness(make_scheduler(**kwargs), FakeRunner(token_source=scripted(scripts, default=7)))  # type: ignore[arg-type]


# ---------------------------------------------------------------- stop checks


def test_eos_stops_and_is_kept() -> None:
    h = _harness({"a": [5, 6, EOS, 9]})
    h.add(make_request("a", 4, eos_token_id=EOS))
    h.run_until_done()
    assert h.tokens("a") == [5, 6, EOS]
    assert h.finished["a"].finish_reason == FinishReason.STOP
    assert h.finished["a"].stop_reason is None
    assert_no_leaks(h.scheduler)


def test_ignore_eos_runs_to_max_tokens() -> None:
    h = _harness({"a": [EOS, EOS, EOS, EOS]})
    h.add(make_request("a", 4, eos_token_id=EOS, ignore_eos=True, max_tokens=4))
    h.run_until_done()
    assert h.tokens("a") == [EOS] * 4
    assert h.finished["a"].finish_reason == FinishReason.LENGTH
    assert_no_leaks(h.scheduler)


def test_stop_token_id_sets_stop_reason() -> None:
    h = _harness({"a": [5, 11, 12]})
    h.add(make_request("a", 4, stop_token_ids=[12, 11]))
    h.run_until_done()
    assert h.tokens("a") == [5, 11]
    assert h.finished["a"].finish_reason == FinishReason.STOP
    assert h.finished["a"].stop_reason == 11
    assert_no_leaks(h.scheduler)


def test_min_tokens_delays_eos_and_stop_ids() -> None:
    h = _harness({"a": [EOS, 11, EOS, 11, 5], "b": [11, EOS, EOS, 5]})
    h.add(make_request("a", 4, eos_token_id=EOS, stop_token_ids=[11], min_tokens=3))
    h.add(make_request("b", 4, eos_token_id=EOS, stop_token_ids=[11], min_tokens=2))
    h.run_until_done()
    assert h.tokens("a") == [EOS, 11, EOS, 11]  # the first output after min_tokens may stop
    assert h.finished["a"].finish_reason == FinishReason.STOP
    assert h.finished["a"].stop_reason == 11
    assert h.tokens("b") == [11, EOS, EOS]
    assert h.finished["b"].stop_reason is None
    assert_no_leaks(h.scheduler)


def test_max_tokens_caps_length() -> None:
    h = _harness({})
    h.add(make_request("a", 4, max_tokens=3), make_request("b", 4, max_tokens=1))
    h.run_until_done()
    assert len(h.tokens("a")) == 3 and len(h.tokens("b")) == 1
    assert h.finished["a"].finish_reason == FinishReason.LENGTH
    assert_no_leaks(h.scheduler)


def test_max_model_len_caps_prompt_plus_output() -> None:
    h = _harness({}, max_model_len=12)
    h.add(make_request("a", 10, max_tokens=None), make_request("b", 12, max_tokens=None))
    h.run_until_done()
    assert len(h.tokens("a")) == 2  # 10 + 2 = max_model_len
    assert len(h.tokens("b")) == 1  # a full-length prompt still yields one token
    assert h.finished["a"].finish_reason == FinishReason.LENGTH
    assert_no_leaks(h.scheduler)


def test_stop_wins_over_length_on_the_same_token() -> None:
    h = _harness({"a": [5, EOS]})
    h.add(make_request("a", 4, eos_token_id=EOS, max_tokens=2))
    h.run_until_done()
    assert h.finished["a"].finish_reason == FinishReason.STOP
    assert_no_leaks(h.scheduler)


def test_tokens_and_logprobs_past_a_stop_are_trimmed() -> None:
    s = make_scheduler(num_speculative_tokens=3)
    s.add_request(make_request("a", 4, eos_token_id=EOS))
    so = s.schedule()
    s.update_from_output(so, ModelRunnerOutput(["a"], {"a": 0}, [[5]]))
    s.update_draft_token_ids({"a": [6, EOS, 8]})
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 4}
    assert so.scheduled_spec_decode_tokens == {"a": [6, EOS, 8]}
    logprobs = [TokenLogprobs([t], [-0.5]) for t in (6, EOS, 8, 9)]
    out = s.update_from_output(
        so, ModelRunnerOutput(["a"], {"a": 0}, [[6, EOS, 8, 9]], logprobs=[logprobs])
    )
    (result,) = out[0].outputs
    assert result.new_token_ids == [6, EOS]
    assert result.new_logprobs == logprobs[:2]
    assert result.finish_reason == FinishReason.STOP
    assert "a" not in s.requests
    s.schedule()
    assert_no_leaks(s)


# ----------------------------------------------------------- speculative decoding


def test_drafts_are_scheduled_and_rejected_ones_rolled_back() -> None:
    accepted = {"n": 1}
    runner = FakeRunner(accept=lambda _rid, drafts: min(accepted["n"], len(drafts)))
    h = Harness(make_scheduler(num_speculative_tokens=4), runner)
    request = make_request("a", 6, max_tokens=30)
    h.add(request)
    h.step()  # prefill: 6 computed, 7 tokens
    h.scheduler.update_draft_token_ids({"a": [1, 2, 3]})
    so = h.schedule()
    assert so.num_scheduled_tokens == {"a": 4}
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    assert request.num_computed_tokens == 10  # advanced over the drafts
    h.run(so)  # 1 of 3 drafts accepted, plus a bonus token
    assert request.num_output_tokens == 3 and request.output_token_ids[1] == 1
    assert request.num_computed_tokens == 8 == request.num_tokens - 1
    assert request.spec_token_ids == []
    # The fake runner's mirror already cross-checks num_computed_tokens next step.
    accepted["n"] = 0
    h.scheduler.update_draft_token_ids({"a": [4, 4]})
    h.step()
    assert request.num_output_tokens == 4 and request.num_computed_tokens == 9
    h.run_until_done()
    assert len(h.tokens("a")) == 30
    assert_no_leaks(h.scheduler)


def test_drafts_are_trimmed_by_the_budget_and_limit() -> None:
    h = Harness(make_scheduler(num_speculative_tokens=3, max_num_batched_tokens=3))
    h.add(make_request("a", 3, max_tokens=20))
    h.step()
    h.scheduler.update_draft_token_ids({"a": [1, 2, 3, 4, 5]})  # cut to 3
    assert h.scheduler.requests["a"].spec_token_ids == [1, 2, 3]
    so = h.schedule()
    assert so.num_scheduled_tokens == {"a": 3}
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2]}  # budget cut the third
    h.run(so)
    # Drafts for unknown or waiting requests are ignored.
    h.add(make_request("b", 3, max_tokens=2))
    h.scheduler.update_draft_token_ids({"b": [1], "nope": [1]})
    assert h.scheduler.requests["b"].spec_token_ids == []
    h.run_until_done()
    assert len(h.tokens("a")) == 20
    assert_no_leaks(h.scheduler)


def test_draft_slots_cross_block_boundaries() -> None:
    h = Harness(make_scheduler(block_size=4, num_speculative_tokens=6))
    h.add(make_request("a", 3, max_tokens=100))
    h.step()
    for _ in range(8):
        h.scheduler.update_draft_token_ids({"a": [9] * 6})
        so = h.step()
        assert so.num_scheduled_tokens["a"] == 7
    request = h.scheduler.requests["a"]
    assert request.num_output_tokens == 1 + 8 * 7
    # Every slot up to the last computed token has a block.
    assert len(h.scheduler.kv_cache_manager.get_block_ids("a")) * 4 >= request.num_tokens - 1
    h.run_until_done()
    assert_no_leaks(h.scheduler)


# -------------------------------------------------------------------- aborts


def test_abort_in_every_state() -> None:
    # 4 usable blocks: run and pre take them all, wait cannot be admitted.
    h = Harness(make_scheduler(block_size=4, num_blocks=5, max_num_batched_tokens=16))
    h.add(make_request("run", 7, max_tokens=8), make_request("pre", 7, max_tokens=8))
    h.add(make_request("wait", 10, max_tokens=2))
    h.step()
    h.step()
    so = h.step()
    assert so.preempted_req_ids == {"pre"}
    statuses = {r: h.scheduler.requests[r].status for r in ("run", "pre", "wait")}
    assert statuses == {
        "run": RequestStatus.RUNNING,
        "pre": RequestStatus.PREEMPTED,
        "wait": RequestStatus.WAITING,
    }
    pre = h.scheduler.requests["pre"]
    h.scheduler.finish_requests(["pre", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert pre.status == RequestStatus.FINISHED_ABORTED
    assert h.scheduler.get_request_counts() == (1, 0)
    h.scheduler.finish_requests("run", RequestStatus.FINISHED_ABORTED)
    assert h.scheduler.get_request_counts() == (0, 0)
    so = h.step()
    assert so.finished_req_ids == {"pre", "wait", "run"}
    assert so.num_scheduled_tokens == {}
    assert_no_leaks(h.scheduler)


def test_abort_between_schedule_and_update_is_skipped() -> None:
    h = Harness(make_scheduler())
    h.add(make_request("a", 5, max_tokens=4), make_request("b", 5, max_tokens=4))
    so = h.schedule()
    mro = h.runner.execute(so)
    h.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    out = h.scheduler.update_from_output(so, mro)
    assert [o.request_id for o in out[0].outputs] == ["b"]
    so = h.step()
    assert so.finished_req_ids == {"a"} and "a" not in so.num_scheduled_tokens
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_request_finished_by_the_frontend_uses_the_given_status() -> None:
    h = Harness(make_scheduler())
    request = make_request("a", 5, max_tokens=10)
    h.add(request)
    h.step()
    h.scheduler.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert request.status == RequestStatus.FINISHED_STOPPED
    h.run_until_done()
    assert "a" not in h.finished  # the frontend already knows
    assert_no_leaks(h.scheduler)


# ------------------------------------------------------------ ignored requests


def test_prompt_longer_than_max_model_len_is_ignored() -> None:
    h = Harness(make_scheduler(max_model_len=16))
    h.add(make_request("long", 17), make_request("ok", 16, max_tokens=1))
    assert h.scheduler.get_request_counts() == (0, 1)
    assert h.scheduler.has_finished_requests()
    h.run_until_done()
    assert h.finished["long"].finish_reason == FinishReason.LENGTH
    assert h.finished["long"].new_token_ids == []
    assert len(h.tokens("ok")) == 1
    assert_no_leaks(h.scheduler)


def test_prompt_larger_than_the_whole_cache_is_ignored() -> None:
    h = Harness(make_scheduler(block_size=4, num_blocks=5))  # 16 slots
    h.add(make_request("big", 17), make_request("fits", 16, max_tokens=1))
    h.run_until_done()
    assert h.finished["big"].finish_reason == FinishReason.LENGTH
    assert h.finished["big"].new_token_ids == []
    assert h.finished["fits"].new_token_ids != []
    assert_no_leaks(h.scheduler)


def test_unchunkable_prompt_larger_than_the_budget_is_ignored() -> None:
    h = Harness(make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=8))
    h.add(make_request("big", 9), make_request("ok", 8, max_tokens=2))
    h.run_until_done()
    assert h.finished["big"].finish_reason == FinishReason.LENGTH
    assert len(h.tokens("ok")) == 2
    assert_no_leaks(h.scheduler)


# ------------------------------------------------------------ clients, stats


def test_outputs_are_grouped_by_client() -> None:
    h = Harness(make_scheduler())
    h.add(make_request("a", 4, client_index=0, max_tokens=2))
    h.add(make_request("b", 4, client_index=3, max_tokens=2))
    h.add(make_request("c", 4, client_index=0, max_tokens=2))
    so = h.schedule()
    result = h.run(so)
    assert sorted(result) == [0, 3]
    assert [o.request_id for o in result[0].outputs] == ["a", "c"]
    assert [o.request_id for o in result[3].outputs] == ["b"]
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_finished_requests_lists_what_finished_per_client() -> None:
    h = _harness({"a": [5, EOS]}, max_model_len=16)
    h.add(make_request("a", 4, eos_token_id=EOS, client_index=0))
    h.add(make_request("b", 4, max_tokens=10, client_index=0))
    h.add(make_request("c", 4, max_tokens=1, client_index=3))
    h.add(make_request("long", 17, client_index=3))  # ignored: longer than max_model_len
    out = h.step_outputs()
    assert sorted(out) == [0, 3]
    assert out[0].finished_requests is None
    assert out[3].finished_requests == {"c", "long"}
    h.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    out = h.step_outputs()
    assert sorted(out) == [0]
    assert out[0].finished_requests == {"a", "b"}  # a stopped; b was aborted
    assert [o.request_id for o in out[0].outputs] == ["a"]
    assert h.scheduler.has_finished_requests()
    assert h.step_outputs() == {}
    assert_no_leaks(h.scheduler)


def test_stats_are_deltas_since_the_previous_snapshot() -> None:
    h = Harness(make_scheduler(block_size=4, num_blocks=5, log_stats=True))
    prompt = list(range(100, 107))
    h.add(make_request("a", prompt, max_tokens=8))
    out = h.run(h.schedule())
    stats = out[0].scheduler_stats
    assert stats is not None
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 0)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (7, 0)
    assert stats.kv_cache_usage == 0.5
    h.add(make_request("b", prompt, max_tokens=8))
    out = h.run(h.schedule())
    stats = out[0].scheduler_stats
    assert stats is not None
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (7, 4)
    assert stats.num_preemptions == 0
    preemptions = preempted_ids = 0
    while h.scheduler.has_requests():
        so = h.schedule()
        preempted_ids += len(so.preempted_req_ids)
        out = h.run(so)
        stats = out[0].scheduler_stats  # present even when no request produced output
        assert stats is not None
        preemptions += stats.num_preemptions
    assert preemptions == preempted_ids >= 1
    assert h.scheduler.make_stats() == type(stats)(0, 0, 0.0, 0, 0, 0)
    assert make_scheduler().make_stats() is None
    assert_no_leaks(h.scheduler)


def test_reset_prefix_cache_with_running_requests() -> None:
    h = Harness(make_scheduler(block_size=4))
    h.add(make_request("a", 9, max_tokens=5), make_request("b", 9, max_tokens=5))
    h.step()
    assert h.scheduler.reset_prefix_cache() is False  # blocks in use
    assert h.scheduler.reset_prefix_cache(reset_running_requests=True) is True
    assert [r.status for r in h.scheduler.waiting] == [RequestStatus.PREEMPTED] * 2
    assert [r.request_id for r in h.scheduler.waiting] == ["a", "b"]
    so = h.step()  # reports the preemption, admits nothing
    assert so.preempted_req_ids == {"a", "b"} and so.num_scheduled_tokens == {}
    so = h.step()
    assert so.scheduled_cached_reqs.resumed_req_ids == {"a", "b"}
    assert so.num_scheduled_tokens == {"a": 10, "b": 10}  # nothing cached any more
    h.run_until_done()
    assert [len(h.tokens(r)) for r in "ab"] == [5, 5]
    h.scheduler.shutdown()
    assert_no_leaks(h.scheduler)


def test_duplicate_ids_and_non_finished_status_are_rejected() -> None:
    h = Harness(make_scheduler())
    h.add(make_request("a", 4, max_tokens=1))
    with pytest.raises(ValueError, match="request_id"):
        h.scheduler.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="finished_status"):
        h.scheduler.finish_requests("a", RequestStatus.RUNNING)
    assert h.scheduler.get_request_counts() == (0, 1)
    h.run_until_done()
    assert_no_leaks(h.scheduler)
