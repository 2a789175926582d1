"""The scheduler with a KV connector: a fake one, driven by hand-written worker reports.

The fake connector's store "holds" a chosen number of tokens of chosen
requests; the tests play the worker side by attaching ``KVConnectorOutput``s
to the fake runner's outputs. Every test ends with the leak check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tests.core.utils import Harness, assert_no_leaks, make_request, make_scheduler
from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.kv_transfer.base import BlockList, KVConnectorBase
from tokenloom.outputs import EngineCoreOutputs, KVConnectorOutput, KVTransferStats
from tokenloom.request import Request, RequestStatus


@dataclass
class FakeMeta:
    loads: dict[str, tuple[list[int], int]]
    step: int


@dataclass
class FakeConnector(KVConnectorBase):
    """``held[req_id]``: tokens of the request's prompt the store holds (from token 0)."""

    held: dict[str, int] = field(default_factory=dict)
    load_async: bool = True
    delay_free: set[str] = field(default_factory=set)
    ask_later: dict[str, int] = field(default_factory=dict)
    allocs: dict[str, tuple[list[int], int]] = field(default_factory=dict)
    finished: dict[str, list[int]] = field(default_factory=dict)
    reports: list[KVConnectorOutput] = field(default_factory=list)
    metas: list[FakeMeta] = field(default_factory=list)
    _new_loads: dict[str, tuple[list[int], int]] = field(default_factory=dict)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.ask_later.get(request.request_id, 0) > 0:
            self.ask_later[request.request_id] -= 1
            return None, False
        num = max(self.held.get(request.request_id, 0) - num_computed_tokens, 0)
        return num, self.load_async and num > 0

    def update_state_after_alloc(
        self, request: Request, blocks: BlockList, num_external_tokens: int
    ) -> None:
        self.allocs[request.request_id] = (blocks.get_block_ids(), num_external_tokens)
        if num_external_tokens:
            self._new_loads[request.request_id] = (blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> FakeMeta:
        meta = FakeMeta(self._new_loads, len(self.metas))
        self._new_loads = {}
        self.metas.append(meta)
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.reports.append(output)
        for block_id in output.invalid_block_ids:
            # A store that failed to load a block no longer claims it.
            for req_id, (blocks, _) in self.allocs.items():
                if block_id in blocks:
                    self.held[req_id] = 0

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.finished[request.request_id] = block_ids
        return request.request_id in self.delay_free, {"sent_by": request.request_id}


def harness(connector: FakeConnector, **kwargs: Any) -> Harness:
    kwargs.setdefault("block_size", 4)
    h = Harness(make_scheduler(kv_connector=connector, log_stats=True, **kwargs))
    h.kv_stats = KVTransferStats()  # type: ignore[attr-defined]
    return h


def step_with(h: Harness, report: KVConnectorOutput | None = None) -> SchedulerOutput:
    so = h.schedule()
    mro = h.runner.execute(so)
    mro.kv_connector_output = report
    result = h.scheduler.update_from_output(so, mro)
    record(h, result)
    return so


def drive(h: Harness, max_steps: int = 1000) -> None:
    """Run to the end, the worker side finishing every load in the step after it starts."""
    for _ in range(max_steps):
        if not h.scheduler.has_requests():
            return
        loading = {
            r.request_id
            for r in h.scheduler.waiting
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        }
        step_with(h, KVConnectorOutput(finished_recving=loading))
    raise AssertionError("no progress")


def record(h: Harness, result: dict[int, EngineCoreOutputs]) -> None:
    for outs in result.values():
        if outs.scheduler_stats is not None:
            assert outs.scheduler_stats.kv_transfer_stats is not None
            h.kv_stats.merge(outs.scheduler_stats.kv_transfer_stats)  # type: ignore[attr-defined]
        for out in outs.outputs:
            h.outputs.setdefault(out.request_id, []).append(out)
            if out.finish_reason is not None:
                h.finished[out.request_id] = out


def test_async_load_waits_without_blocking_others() -> None:
    connector = FakeConnector(held={"a": 32})
    h = harness(connector)
    a = make_request("a", 40, max_tokens=3)
    h.add(a, make_request("b", 10, max_tokens=3))
    so = step_with(h)
    # a loads (its blocks allocated, not scheduled); b behind it runs.
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert list(so.num_scheduled_tokens) == ["b"]
    assert so.kv_connector_metadata is connector.metas[-1]
    assert so.kv_connector_metadata.loads == {"a": (connector.allocs["a"][0], 32)}
    blocks = h.scheduler.kv_cache_manager.get_block_ids("a")
    assert len(blocks) == 8 and connector.allocs["a"] == (blocks, 32)
    # Its blocks hold no KV yet: another request with the same prompt cannot hit them.
    twin = make_request("twin", list(a.prompt_token_ids), max_tokens=1)
    assert h.scheduler.kv_cache_manager.get_computed_blocks(twin)[1] == 0
    for _ in range(3):
        so = step_with(h)
        assert "a" not in so.num_scheduled_tokens
        assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step_with(h, KVConnectorOutput(finished_recving={"a"}))
    so = step_with(h)
    (new,) = so.scheduled_new_reqs
    assert new.req_id == "a" and new.num_computed_tokens == 32
    assert so.num_scheduled_tokens["a"] == 8
    assert a.num_cached_tokens == 32
    h.run_until_done()
    assert len(h.tokens("a")) == 3 and len(h.tokens("b")) == 3
    assert h.scheduler.kv_cache_manager.get_computed_blocks(twin)[1] == 36
    assert_no_leaks(h.scheduler)


def test_whole_prompt_loaded_still_computes_the_last_token() -> None:
    connector = FakeConnector(held={"a": 40})
    h = harness(connector)
    a = make_request("a", 40, max_tokens=2)
    h.add(a)
    step_with(h)
    step_with(h, KVConnectorOutput(finished_recving={"a"}))
    so = step_with(h)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 39
    assert so.num_scheduled_tokens == {"a": 1}
    assert h.kv_stats.num_hit_tokens == 39  # type: ignore[attr-defined]
    assert h.kv_stats.num_queried_tokens == 40  # type: ignore[attr-defined]
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_failed_async_load_recomputes_from_the_first_bad_block() -> None:
    connector = FakeConnector(held={"a": 32})
    h = harness(connector)
    a = make_request("a", 40, max_tokens=2)
    h.add(a)
    step_with(h)
    blocks = h.scheduler.kv_cache_manager.get_block_ids("a")
    # Blocks 3 and 6 fail: everything from block 3 on is recomputed.
    step_with(
        h, KVConnectorOutput(finished_recving={"a"}, invalid_block_ids={blocks[3], blocks[6]})
    )
    so = step_with(h)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12
    assert so.num_scheduled_tokens == {"a": 28}
    assert h.kv_stats.num_recomputed_tokens == 20  # type: ignore[attr-defined]
    assert h.kv_stats.num_hit_tokens == 12  # type: ignore[attr-defined]
    # Only the three good blocks were cached when the load ended; the rest after compute.
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_load_that_failed_entirely_starts_over() -> None:
    connector = FakeConnector(held={"a": 16})
    h = harness(connector)
    a = make_request("a", 20, max_tokens=2)
    h.add(a)
    step_with(h)
    blocks = h.scheduler.kv_cache_manager.get_block_ids("a")
    step_with(h, KVConnectorOutput(finished_recving={"a"}, invalid_block_ids={blocks[0]}))
    so = step_with(h)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert so.num_scheduled_tokens == {"a": 20}
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_failed_sync_load_preempts_and_drops_the_step_tokens() -> None:
    connector = FakeConnector(held={"a": 16}, load_async=False)
    h = harness(connector)
    a = make_request("a", 20, max_tokens=3)
    h.add(a)
    so = h.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    assert so.num_scheduled_tokens == {"a": 4}
    blocks = h.scheduler.kv_cache_manager.get_block_ids("a")
    # A second request admitted in the same step hit a loaded block.
    mro = h.runner.execute(so)
    mro.kv_connector_output = KVConnectorOutput(invalid_block_ids={blocks[2]})
    record(h, h.scheduler.update_from_output(so, mro))
    assert h.tokens("a") == []  # the token sampled on bad KV is dropped
    h.runner.given["a"].pop()
    assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    # The failed block left the prefix cache; the two before it still hit.
    assert h.scheduler.kv_cache_manager.get_computed_blocks(a)[1] == 8
    so = h.schedule()
    assert so.preempted_req_ids == {"a"} and not so.num_scheduled_tokens
    h.run(so)
    so = h.schedule()
    assert so.scheduled_cached_reqs.resumed_req_ids == {"a"}
    assert so.scheduled_cached_reqs.num_computed_tokens == [8]
    h.run(so)
    h.run_until_done()
    assert len(h.tokens("a")) == 3
    assert_no_leaks(h.scheduler)


def test_delayed_free_holds_blocks_until_finished_sending() -> None:
    connector = FakeConnector(delay_free={"a"})
    h = harness(connector, num_blocks=64)
    h.add(make_request("a", 18, max_tokens=1), make_request("b", 6, max_tokens=1))
    step_with(h)
    assert h.finished["a"].kv_transfer_params == {"sent_by": "a"}
    assert h.finished["b"].kv_transfer_params == {"sent_by": "b"}
    manager = h.scheduler.kv_cache_manager
    assert (
        connector.finished["a"] == manager.get_block_ids("a") and len(connector.finished["a"]) == 5
    )
    assert manager.get_block_ids("b") == []  # b was not held
    assert "a" not in h.scheduler.requests and not h.scheduler.has_unfinished_requests()
    assert h.scheduler.has_requests()  # the engine keeps stepping the worker side
    step_with(h)
    assert len(manager.get_block_ids("a")) == 5
    step_with(h, KVConnectorOutput(finished_sending={"a"}))
    assert manager.get_block_ids("a") == []
    assert not h.scheduler.has_requests()
    assert_no_leaks(h.scheduler)


def test_abort_while_loading_holds_blocks_until_the_load_ends() -> None:
    connector = FakeConnector(held={"a": 16})
    h = harness(connector)
    h.add(make_request("a", 20))
    step_with(h)
    manager = h.scheduler.kv_cache_manager
    blocks = manager.get_block_ids("a")
    h.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert "a" not in h.scheduler.requests and len(h.scheduler.waiting) == 0
    assert connector.finished["a"] == blocks
    # The load may still write them: nobody else gets them until it ends.
    assert manager.get_block_ids("a") == blocks and h.scheduler.has_requests()
    step_with(h)
    step_with(h, KVConnectorOutput(finished_recving={"a"}))
    assert manager.get_block_ids("a") == []
    assert_no_leaks(h.scheduler)


def test_preemption_while_loading() -> None:
    """A running request is preempted while another loads; the loading one keeps its
    blocks, and the preempted one, found in the store when it comes back, loads too
    and resumes. (No prefix caching: b's own freed blocks would hit first.)"""
    connector = FakeConnector(held={"a": 16})
    h = harness(connector, num_blocks=12, max_num_batched_tokens=64, enable_prefix_caching=False)
    a = make_request("a", 20, max_tokens=2)
    b = make_request("b", 22, max_tokens=20)
    h.add(b)
    step_with(h)
    h.add(a)
    step_with(h)
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    a_blocks = h.scheduler.kv_cache_manager.get_block_ids("a")
    assert len(a_blocks) == 4
    # 11 usable blocks: a holds 4; b grows past the 7 left and is preempted.
    while b.status == RequestStatus.RUNNING:
        step_with(h)
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert h.scheduler.kv_cache_manager.get_block_ids("a") == a_blocks
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # The store now holds b's first 24 tokens; b comes back through a load too.
    connector.held["b"] = 24
    step_with(h)
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert connector.allocs["b"][1] == 24
    step_with(h, KVConnectorOutput(finished_recving={"a", "b"}))
    # b goes first but needs 2 more blocks, 1 is free and nothing runs: a gives
    # its loaded blocks back (it loads again later) rather than both waiting forever.
    so = h.schedule()
    assert so.scheduled_cached_reqs.resumed_req_ids == {"b"}
    assert so.scheduled_cached_reqs.num_computed_tokens == [24]
    assert so.num_scheduled_tokens == {"b": b.num_tokens - 24}
    assert a.num_computed_tokens == 0 and h.scheduler.kv_cache_manager.get_block_ids("a") == []
    h.run(so)
    drive(h)
    assert len(h.tokens("a")) == 2 and len(h.tokens("b")) == 20
    assert len(connector.allocs) == 2 and connector.allocs["a"][1] == 16
    assert_no_leaks(h.scheduler)


def test_none_means_ask_again_and_others_go_first() -> None:
    connector = FakeConnector(ask_later={"a": 2})
    h = harness(connector)
    h.add(make_request("a", 8, max_tokens=1), make_request("b", 8, max_tokens=1))
    so = step_with(h)
    assert list(so.num_scheduled_tokens) == ["b"]
    assert [r.request_id for r in h.scheduler.waiting] == ["a"]
    so = step_with(h)
    assert not so.num_scheduled_tokens
    so = step_with(h)
    assert list(so.num_scheduled_tokens) == ["a"]
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_every_admission_and_finish_reaches_the_connector() -> None:
    connector = FakeConnector()
    h = harness(connector)
    h.add(make_request("a", 9, max_tokens=2), make_request("b", 5, max_tokens=2))
    h.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    steps = 0
    while h.scheduler.has_requests():
        step_with(h, KVConnectorOutput())
        steps += 1
    assert connector.allocs == {"a": (connector.finished["a"], 0)}
    assert sorted(connector.finished) == ["a", "b"] and connector.finished["b"] == []
    assert len(connector.metas) == steps and len(connector.reports) == steps
    assert_no_leaks(h.scheduler)
