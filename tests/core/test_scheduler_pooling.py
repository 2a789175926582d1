"""Pooling requests in the scheduler: prefilled like any prompt (chunked, batched,
from the prefix cache when their pooling allows it), never decoded, finished by
the step whose runner output carries their pooled vector. Every test ends with
the leak check."""

from __future__ import annotations

from tests.core.utils import FakeRunner, Harness, assert_no_leaks, make_request, make_scheduler
from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.outputs import ModelRunnerOutput
from tokenloom.pooling_params import PoolingParams
from tokenloom.request import FinishReason, Request, RequestStatus
from tokenloom.sampling_params import SamplingParams


class PoolingRunner(FakeRunner):
    """A runner without a model that pools the pooling requests: one whose prompt
    this step completes gets its pooled vector (its id and prompt length, as
    bytes) and no token; a pooling request scheduled again after that would be a
    decode, and fails. Other requests sample as in FakeRunner."""

    def __init__(self) -> None:
        super().__init__()
        self.pooling: set[str] = set()
        self.pooled: set[str] = set()
        self.starts: dict[str, list[int]] = {}  # each chunk's first position

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for new in so.scheduled_new_reqs:
            if new.pooling_params is not None:
                self.pooling.add(new.req_id)
            self.starts.setdefault(new.req_id, []).append(new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for req_id, start in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self.starts.setdefault(req_id, []).append(start)
        out = super().execute(so)
        pooled: list[bytes | None] = [None] * len(out.req_ids)
        for i, req_id in enumerate(out.req_ids):
            if req_id in self.pooling and out.sampled_token_ids[i]:
                assert req_id not in self.pooled, f"{req_id} decoded after pooling"
                self.pooled.add(req_id)
                out.sampled_token_ids[i] = []
                pooled[i] = f"{req_id}:{len(self.prompts[req_id])}".encode()
        out.pooler_output = pooled
        return out


def pooling_request(req_id: str, prompt: int | list[int], **params: object) -> Request:
    base = make_request(req_id, prompt, max_tokens=1)
    return Request(
        req_id,
        base.prompt_token_ids,
        SamplingParams(max_tokens=1),
        arrival_time=base.arrival_time,
        pooling_params=PoolingParams(**params),  # type: ignore[arg-type]
    )


def test_a_pooling_request_finishes_after_its_last_chunk_and_never_decodes() -> None:
    runner = PoolingRunner()
    h = Harness(make_scheduler(max_num_batched_tokens=8, block_size=4), runner)
    h.add(pooling_request("p", 20))
    for _ in range(3):  # 8 + 8 + 4 prompt tokens
        h.step()
    assert runner.starts["p"] == [0, 8, 16]
    assert h.scheduler.get_request_counts() == (0, 0)  # finished: no decode step
    so = h.step()
    assert so.total_num_scheduled_tokens == 0 and so.finished_req_ids == {"p"}
    final = h.finished["p"]
    assert final.finish_reason == FinishReason.STOP
    assert final.new_token_ids == [] and final.pooling_output == b"p:20"
    assert [o.pooling_output for o in h.outputs["p"]] == [b"p:20"]  # one output, at the end
    assert_no_leaks(h.scheduler)


def test_pooling_requests_batch_with_each_other_and_with_generation() -> None:
    runner = PoolingRunner()
    h = Harness(make_scheduler(max_num_batched_tokens=64), runner)
    h.add(pooling_request("p1", 10), make_request("g", 6, max_tokens=3), pooling_request("p2", 12))
    so = h.step()
    assert so.num_scheduled_tokens == {"p1": 10, "g": 6, "p2": 12}
    assert set(h.finished) == {"p1", "p2"}  # both pooled in the first step
    assert h.scheduler.get_request_counts() == (1, 0)
    # Their blocks are free already; the next step tells the runner they finished.
    so = h.step()
    assert so.finished_req_ids == {"p1", "p2"} and list(so.num_scheduled_tokens) == ["g"]
    h.run_until_done()
    assert len(h.tokens("g")) == 3 and h.tokens("p1") == h.tokens("p2") == []
    assert_no_leaks(h.scheduler)


def test_last_token_pooling_reads_the_prefix_cache() -> None:
    runner = PoolingRunner()
    h = Harness(make_scheduler(block_size=4), runner)
    prompt = list(range(100, 118))  # four full blocks and two tokens
    h.add(pooling_request("first", prompt))
    h.run_until_done()
    h.add(pooling_request("again", prompt))
    so = h.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    assert so.num_scheduled_tokens == {"again": 2}
    assert h.finished["again"].num_cached_tokens == 16
    assert_no_leaks(h.scheduler)


def test_pooling_that_reads_every_token_skips_the_prefix_cache() -> None:
    runner = PoolingRunner()
    h = Harness(make_scheduler(block_size=4, log_stats=True), runner)
    prompt = list(range(100, 118))
    h.add(pooling_request("first", prompt, skip_reading_prefix_cache=True))
    h.run_until_done()
    h.add(pooling_request("again", prompt, skip_reading_prefix_cache=True))
    so = h.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert so.num_scheduled_tokens == {"again": 18}
    assert h.finished["again"].num_cached_tokens == 0
    # Its blocks were still written to the cache for later readers.
    h.add(pooling_request("reader", prompt))
    so = h.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    assert_no_leaks(h.scheduler)


def test_a_preempted_pooling_request_is_recomputed_from_the_start() -> None:
    runner = PoolingRunner()
    # 8 usable blocks of 4 tokens: g (24 tokens in all) and p (28) cannot both fit.
    h = Harness(
        make_scheduler(
            max_num_batched_tokens=8, block_size=4, num_blocks=9, enable_prefix_caching=False
        ),
        runner,
    )
    h.add(make_request("g", 4, max_tokens=20), pooling_request("p", 28))
    steps = 0
    while h.scheduler.has_requests():
        h.step()
        steps += 1
        assert steps < 200
    assert h.finished["p"].pooling_output == b"p:28"
    assert len(h.tokens("g")) == 20
    starts = runner.starts["p"]
    assert starts.count(0) >= 2, f"p was never preempted: chunks started at {starts}"
    assert_no_leaks(h.scheduler)


def test_an_aborted_pooling_request_frees_its_blocks() -> None:
    runner = PoolingRunner()
    h = Harness(make_scheduler(max_num_batched_tokens=8, block_size=4), runner)
    h.add(pooling_request("p", 20))
    h.step()
    assert h.scheduler.kv_cache_manager.usage > 0
    h.scheduler.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    so = h.step()
    assert so.finished_req_ids == {"p"}
    assert "p" not in h.finished
    assert_no_leaks(h.scheduler)
