"""EngineCore and the core process loop, with a fake model runner (no model, no weights)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from tests.core.utils import FakeRunner
from tokenloom.config import CacheConfig, ModelConfig, SchedulerConfig
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


class FakeModelRunner:
    """The ModelRunner surface EngineCore uses; tokens are always 7."""

    def __init__(self, model_config: Any, cache_config: CacheConfig, scheduler_config: Any):
        self.num_blocks = cache_config.num_blocks
        self.max_model_len = 128
        self.arch = SimpleNamespace(eos_token_ids=[EOS], vocab_size=100)
        self.fake = FakeRunner(token_source=lambda _req_id: 7)
        self.calls: list[Any] = []

    def execute_model(self, scheduler_output: Any) -> Any:
        self.calls.append(scheduler_output)
        return self.fake.execute(scheduler_output)


@pytest.fixture()
def core(monkeypatch: pytest.MonkeyPatch) -> EngineCore:
    import tokenloom.worker.model_runner as model_runner

    monkeypatch.setattr(model_runner, "ModelRunner", FakeModelRunner)
    return EngineCore(ModelConfig(), CacheConfig(block_size=4, num_blocks=64), SchedulerConfig())


def request(req_id: str, max_tokens: int, prompt: list[int] | None = None) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(req_id, prompt or [1, 2, 3, 4, 5], params, EOS, arrival_time=1.0)


def usage(core: EngineCore) -> float:
    return core.scheduler.kv_cache_manager.usage


def test_max_model_len_fits_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    import tokenloom.worker.model_runner as model_runner

    monkeypatch.setattr(model_runner, "ModelRunner", FakeModelRunner)
    small = EngineCore(ModelConfig(), CacheConfig(block_size=4, num_blocks=9), SchedulerConfig())
    assert small.max_model_len == 32  # 8 usable blocks of 4 (block 0 is reserved)
    assert small.cache_config.num_blocks == 9


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
