"""EngineCore and the core process loop, with an injected fake model runner (no model, no torch)."""

from __future__ import annotations

import threading

import pytest
import zmq

from tests.engine.fakes import FakeModelRunner
from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.engine import core_proc
from tokenloom.engine.core import EngineCore
from tokenloom.engine.messages import (
    AbortRequests,
    CoreOutputs,
    EngineCoreRequest,
    Shutdown,
    encode,
    output_decoder,
)
from tokenloom.sampling_params import SamplingParams

EOS = 0


def make_core(num_blocks: int = 64, max_model_len: int = 128) -> tuple[EngineCore, FakeModelRunner]:
    runner = FakeModelRunner(num_blocks, max_model_len)
    core = EngineCore(runner, CacheConfig(block_size=4, num_blocks=num_blocks), SchedulerConfig())
    return core, runner


@pytest.fixture()
def core() -> EngineCore:
    return make_core()[0]


def request(req_id: str, max_tokens: int, prompt: list[int] | None = None) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(req_id, prompt or [1, 2, 3, 4, 5], params, EOS, arrival_time=1.0)


def usage(core: EngineCore) -> float:
    return core.scheduler.kv_cache_manager.usage


def test_max_model_len_fits_the_cache() -> None:
    small, _ = make_core(num_blocks=9)
    assert small.max_model_len == 32  # 8 usable blocks of 4 (block 0 is reserved)
    assert small.cache_config.num_blocks == 9
    big, _ = make_core(num_blocks=1000, max_model_len=128)
    assert big.max_model_len == 128  # the runner's own limit


def test_the_tenant_reaches_the_schedulers_request() -> None:
    runner = FakeModelRunner(64, 128)
    core = EngineCore(
        runner, CacheConfig(block_size=4, num_blocks=64), SchedulerConfig(policy="fair")
    )
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    core.add_request(
        EngineCoreRequest(
            "t", [1, 2, 3], params, EOS, arrival_time=1.0, tenant="team-a", tenant_weight=4.0
        )
    )
    request = core.scheduler.requests["t"]
    assert (request.tenant, request.tenant_weight) == ("team-a", 4.0)
    while core.step() is not None:
        pass
    assert not core.scheduler.has_requests()


def test_the_given_runner_runs_every_step() -> None:
    core, runner = make_core()
    core.add_request(request("a", max_tokens=2))
    assert core.runner is runner
    first = core.step()
    assert first is not None and len(runner.calls) == 1
    assert runner.calls[0].num_scheduled_tokens == {"a": 5}
    (out,) = first.outputs.outputs
    assert out.new_token_ids == [7]


def test_step_runs_requests_to_completion(core: EngineCore) -> None:
    assert core.step() is None and not core.runner.calls  # idle: nothing executed
    core.add_request(request("a", max_tokens=3))
    first = core.step()
    assert first is not None
    (out,) = first.outputs.outputs
    assert out.request_id == "a" and out.new_token_ids == [7]
    assert "a" in first.first_scheduled_times
    assert first.outputs.scheduler_stats is not None
    assert first.outputs.scheduler_stats.num_running_reqs == 1
    tokens = [7]
    while True:
        result = core.step()
        assert result is not None
        (out,) = result.outputs.outputs
        assert "a" not in result.first_scheduled_times
        tokens += out.new_token_ids
        if out.finished:
            break
    assert tokens == [7, 7, 7] and out.finish_reason == "length"
    # One more step tells the runner the request is gone, without running anything.
    final = core.step()
    assert final is not None and final.outputs.outputs == []
    assert core.runner.calls[-1].finished_req_ids == {"a"}
    assert core.runner.calls[-1].total_num_scheduled_tokens == 0
    assert core.step() is None and usage(core) == 0.0


def test_abort_frees_blocks_at_once(core: EngineCore) -> None:
    core.add_request(request("long", max_tokens=50))
    core.step()
    assert usage(core) > 0
    core.abort_requests(["long", "unknown"])
    assert usage(core) == 0.0
    stats = core.make_stats_output().outputs.scheduler_stats
    assert stats is not None and stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0


def test_serve_loop_over_zmq(core: EngineCore) -> None:
    context = zmq.Context()
    core_in = context.socket(zmq.PULL)
    core_in.bind("inproc://in")
    front_out = context.socket(zmq.PULL)
    front_out.bind("inproc://out")
    core_out = context.socket(zmq.PUSH)
    core_out.connect("inproc://out")
    front_in = context.socket(zmq.PUSH)
    front_in.connect("inproc://in")
    thread = threading.Thread(target=core_proc._serve, args=(core, core_in, core_out))
    thread.start()
    try:

        def receive() -> CoreOutputs:
            assert front_out.poll(10_000), "no output from the core loop"
            message = output_decoder.decode(front_out.recv())
            assert isinstance(message, CoreOutputs)
            return message

        front_in.send(encode(request("short", max_tokens=2)))
        front_in.send(encode(request("long", max_tokens=100, prompt=[9, 8, 7])))
        finished: dict[str, str] = {}
        while "short" not in finished:
            for out in receive().outputs.outputs:
                if out.finished:
                    finished[out.request_id] = str(out.finish_reason)
        assert finished == {"short": "length"}
        front_in.send(encode(AbortRequests(["long"])))
        # The loop keeps reporting until the abort shows: nothing running, cache free.
        for _ in range(200):
            stats = receive().outputs.scheduler_stats
            if stats is not None and stats.num_running_reqs == 0 and stats.kv_cache_usage == 0:
                break
        else:
            pytest.fail("abort never showed in the stats")
        front_in.send(encode(Shutdown()))
        thread.join(timeout=10)
        assert not thread.is_alive()
    finally:
        front_in.send(encode(Shutdown()))
        thread.join(timeout=10)
        for sock in (core_in, core_out, front_in, front_out):
            sock.close(linger=0)
        context.term()


def run_to_end(core: EngineCore, req: EngineCoreRequest) -> int:
    """Run one request alone; its prefix-cache hit in tokens."""
    core.add_request(req)
    cached = None
    while (result := core.step()) is not None:
        for out in result.outputs.outputs:
            if out.request_id == req.request_id and cached is None:
                cached = out.num_cached_tokens
    assert cached is not None
    return cached


def test_reset_prefix_cache_forgets_cached_blocks(core: EngineCore) -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert run_to_end(core, request("first", 1, prompt)) == 0
    assert run_to_end(core, request("again", 1, prompt)) == 8  # two full blocks of 4
    assert core.reset_prefix_cache()
    assert run_to_end(core, request("after-reset", 1, prompt)) == 0
    assert usage(core) == 0.0


class DraftingRunner(FakeModelRunner):
    """Proposes two drafts (the token it always samples) for every request that sampled;
    the fake verifier keeps the first of them."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.fake.accept = lambda _req_id, drafts: min(1, len(drafts))
        self.taken = 0

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        self.taken += 1
        last = self.calls[-1]
        return {req_id: [7, 7] for req_id in last.num_scheduled_tokens}


def test_drafts_go_from_the_runner_to_the_scheduler_and_stop_at_max_tokens() -> None:
    from tokenloom.config import SpeculativeConfig

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    runner = DraftingRunner(64)
    core = EngineCore(
        runner,
        CacheConfig(block_size=4, num_blocks=64),
        SchedulerConfig(speculative_config=spec),
    )
    assert core.scheduler.num_speculative_tokens == 2
    core.add_request(request("a", max_tokens=6))
    tokens: list[int] = []
    draft_tokens = accepted = 0
    finish = None
    while (result := core.step()) is not None:
        for out in result.outputs.outputs:
            tokens.extend(out.new_token_ids)
            finish = out.finish_reason
        stats = result.outputs.scheduler_stats
        if stats is not None and stats.spec_decoding_stats is not None:
            draft_tokens += stats.spec_decoding_stats.num_draft_tokens
            accepted += stats.spec_decoding_stats.num_accepted_tokens
    # 1 token from the prefill, then 2 per step (one accepted draft + one sampled);
    # the last step's extra token is cut by max_tokens.
    assert tokens == [7] * 6 and str(finish) == "length"
    assert [call.scheduled_spec_decode_tokens.get("a") for call in runner.calls[1:4]] == [
        [7, 7]
    ] * 3
    assert (draft_tokens, accepted) == (6, 3)
    assert runner.taken == len(runner.calls)
    assert usage(core) == 0.0
