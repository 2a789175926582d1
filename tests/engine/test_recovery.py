"""Crash recovery without a model: resumed requests count their earlier output, the
supervisor keeps to its budget, and AsyncLLM resumes streams on a new core (cores over
a fake runner that can be told to fail at a given step)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tests.engine.fakes import DyingRunner, FakeModelRunner, RestartCounter
from tokenloom.config import CacheConfig, RecoveryConfig, SchedulerConfig
from tokenloom.engine.args import EngineArgs
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.core import EngineCore
from tokenloom.engine.core_client import AsyncInprocClient, InprocClient
from tokenloom.engine.exceptions import EngineDeadError
from tokenloom.engine.input_processor import InputProcessor
from tokenloom.engine.messages import EngineCoreRequest, encode, input_decoder
from tokenloom.engine.output_processor import OutputProcessor
from tokenloom.engine.recovery import InFlight, resumed_request
from tokenloom.engine.setup import EngineSetup
from tokenloom.engine.supervisor import CoreSupervisor
from tokenloom.outputs import EngineCoreOutput, RequestOutput
from tokenloom.request import FinishReason
from tokenloom.sampling_params import SamplingParams

TOKEN = 7  # what the fake runner samples every time
PROMPT = [11, 12, 13, 14, 15]


def core_request(params: SamplingParams, prior: list[int] | None = None) -> EngineCoreRequest:
    request = EngineCoreRequest("r", PROMPT, params, eos_token_id=2, arrival_time=1.0)
    return resumed_request(InFlight(request, prior)) if prior is not None else request


def run_core(request: EngineCoreRequest) -> tuple[list[int], EngineCoreOutput, FakeModelRunner]:
    """Every token the core produces for ``request``, its last output, and the runner."""
    runner = FakeModelRunner(num_blocks=64, max_model_len=128, token=TOKEN)
    core = EngineCore(runner, CacheConfig(block_size=4, num_blocks=64), SchedulerConfig())
    core.add_request(request)
    tokens: list[int] = []
    while True:
        result = core.step()
        assert result is not None
        for output in result.outputs.outputs:
            tokens += output.new_token_ids
            if output.finished:
                return tokens, output, runner


def test_resumed_request_carries_the_output_and_nothing_else_changes() -> None:
    original = core_request(SamplingParams(max_tokens=9, seed=4, temperature=0.5))
    resumed = resumed_request(InFlight(original, [3, 4]))
    assert resumed.prior_output_token_ids == [3, 4]
    assert original.prior_output_token_ids == []
    for field in ("request_id", "prompt_token_ids", "sampling_params", "arrival_time"):
        assert getattr(resumed, field) == getattr(original, field)
    assert input_decoder.decode(encode(resumed)) == resumed  # survives the socket


def test_the_core_recomputes_prompt_and_output_then_continues() -> None:
    tokens, output, runner = run_core(core_request(SamplingParams(max_tokens=6), [1, 2, 3]))
    first = runner.calls[0]
    (new,) = first.scheduled_new_reqs
    assert new.output_token_ids == [1, 2, 3]
    assert first.num_scheduled_tokens["r"] == len(PROMPT) + 3  # prompt and output, recomputed
    assert runner.fake.given["r"] == [1, 2, 3, *tokens]


def test_max_tokens_counts_the_earlier_output() -> None:
    tokens, output, _ = run_core(core_request(SamplingParams(max_tokens=10), [1, 2, 3, 4]))
    assert tokens == [TOKEN] * 6
    assert output.finish_reason == FinishReason.LENGTH


def test_min_tokens_and_stop_ids_count_the_earlier_output() -> None:
    params = SamplingParams(max_tokens=20, min_tokens=5, stop_token_ids=[TOKEN])
    # Outputs 4 and 5 may not stop; output 6 is the first that may.
    tokens, output, _ = run_core(core_request(params, [1, 2, 3]))
    assert tokens == [TOKEN] * 3
    assert output.finish_reason == FinishReason.STOP and output.stop_reason == TOKEN
    # Without the earlier output it would have taken six tokens.
    assert run_core(core_request(params))[0] == [TOKEN] * 6


def test_in_flight_lists_unfinished_sequences_with_their_tokens(tokenizer: Any) -> None:
    inputs = InputProcessor(tokenizer, max_model_len=256, vocab_size=49152, eos_token_ids=[2])
    proc = OutputProcessor(tokenizer)
    for request_id in ("a", "b", "c"):
        text, reqs = inputs.process(request_id, "Hello", SamplingParams(max_tokens=4))
        proc.add_request(request_id, text, reqs)
    proc.process_outputs(
        [
            EngineCoreOutput("a", [5, 6]),
            EngineCoreOutput("b", [5], FinishReason.LENGTH),
            EngineCoreOutput("c", [9]),
        ],
        1.0,
    )
    proc.abort_requests(["c"])
    (a,) = proc.in_flight()
    assert a.request.request_id == "a" and a.output_token_ids == [5, 6]
    assert proc.in_flight(["b", "c", "zz"]) == []
    assert [r.request.request_id for r in proc.in_flight(["a"])] == ["a"]


# ---------------------------------------------------------------- supervisor


def supervisor(
    budget: int, results: list[Any], backoff: float = 0.0
) -> tuple[CoreSupervisor[str], list[str]]:
    """A supervisor whose starts return (or raise) ``results`` in turn."""
    started: list[str] = []
    pending = iter(results)

    async def start() -> str:
        result = next(pending)
        if isinstance(result, Exception):
            raise result
        started.append(result)
        return str(result)

    config = RecoveryConfig(max_engine_restarts=budget, engine_restart_backoff_s=backoff)
    return CoreSupervisor(config, start), started


async def test_failed_starts_count_against_the_budget() -> None:
    sup, started = supervisor(3, [RuntimeError("no"), "core-2"])
    assert await sup.restart("died") == "core-2"
    assert sup.num_restarts == 2 and sup.budget_left == 1 and not sup.restarting
    sup2, _ = supervisor(2, [RuntimeError("no"), RuntimeError("again"), "never"])
    assert await sup2.restart("died") is None
    assert sup2.num_restarts == 2 and "again" in sup2.reason


async def test_backoff_doubles_and_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    sup, _ = supervisor(5, [RuntimeError("x")] * 5, backoff=10.0)
    assert await sup.restart("died") is None
    assert slept == [10.0, 20.0, 30.0, 30.0, 30.0]


def test_recovery_settings_are_checked_naming_the_field() -> None:
    with pytest.raises(ValueError, match="^max_engine_restarts must be an integer >= 0"):
        EngineArgs(max_engine_restarts=-1)
    with pytest.raises(ValueError, match="^engine_restart_backoff_s must be a number >= 0"):
        EngineArgs(engine_restart_backoff_s=-0.5)
    config = EngineArgs(max_engine_restarts=0).config.recovery_config
    assert config.max_engine_restarts == 0


def test_cli_flags() -> None:
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--max-engine-restarts", "5", "--engine-restart-backoff-s", "0.25"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.max_engine_restarts == 5 and engine_args.engine_restart_backoff_s == 0.25


# ---------------------------------------------------------------- AsyncLLM


class Cluster:
    """An AsyncLLM whose successive cores live ``plans[i]`` steps ("fail": never starts)."""

    def __init__(
        self, tokenizer: Any, plans: list[Any], budget: int = 3, gate: asyncio.Event | None = None
    ) -> None:
        (self.token,) = tokenizer.encode("a", add_special_tokens=False)
        self.runners: list[DyingRunner] = []
        pending = iter(plans[1:])

        async def start() -> AsyncInprocClient:
            if gate is not None:
                await gate.wait()
            plan = next(pending)
            if plan == "fail":
                raise RuntimeError("core failed to start")
            return self.client(plan)

        config = RecoveryConfig(max_engine_restarts=budget, engine_restart_backoff_s=0.0)
        self.counter = RestartCounter()
        setup = EngineSetup.from_engine_args(EngineArgs(max_model_len=128, log_stats=False))
        self.engine = AsyncLLM(
            setup,
            self.client(plans[0]),
            tokenizer,
            stat_loggers=[self.counter],
            supervisor=CoreSupervisor(config, start),
        )

    def client(self, steps_to_live: int | None) -> AsyncInprocClient:
        runner, client = dying_core(self.token, steps_to_live)
        self.runners.append(runner)
        return client

    def resumed_priors(self, core: int) -> dict[str, list[int]]:
        """The earlier output each request brought to core ``core`` (by request id)."""
        return resumed_priors(self.runners[core])

    def stream(self, request_id: str, max_tokens: int = 12) -> Awaitable[list[RequestOutput]]:
        return stream(self.engine, request_id, max_tokens)


def dying_core(
    token: int, steps_to_live: int | None, after_requests: int = 0
) -> tuple[DyingRunner, AsyncInprocClient]:
    runner = DyingRunner(token, steps_to_live, after_requests)
    core = EngineCore(runner, CacheConfig(block_size=4, num_blocks=64), SchedulerConfig())
    return runner, AsyncInprocClient(InprocClient(core))


def resumed_priors(runner: DyingRunner) -> dict[str, list[int]]:
    """The earlier output each request brought to the runner's core (by request id)."""
    return {
        new.req_id: new.output_token_ids for call in runner.calls for new in call.scheduled_new_reqs
    }


def stream(engine: AsyncLLM, request_id: str, max_tokens: int) -> Awaitable[list[RequestOutput]]:
    """Collect one "Hi" request's outputs (deltas) in a task."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async def collect() -> list[RequestOutput]:
        return [o async for o in engine.generate("Hi", params, request_id, delta=True)]

    return asyncio.ensure_future(collect())


def joined(outputs: list[RequestOutput]) -> tuple[str, list[int], str | None]:
    pieces = [o.outputs[0] for o in outputs]
    tokens = [t for p in pieces for t in p.token_ids]
    return "".join(p.text for p in pieces), tokens, pieces[-1].finish_reason


async def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.001)


async def test_streams_continue_on_the_new_core_without_repeats_or_gaps(tokenizer: Any) -> None:
    cluster = Cluster(tokenizer, [4, None])
    streams = [cluster.stream(f"r{i}") for i in range(3)]
    results = await asyncio.wait_for(asyncio.gather(*streams), 10)
    for outputs in results:
        assert joined(outputs) == ("a" * 12, [cluster.token] * 12, "length")
    priors = cluster.resumed_priors(1)
    assert set(priors) == {"r0", "r1", "r2"}
    assert any(priors.values()), "no stream had output before the crash: nothing resumed"
    for request_id, prior in priors.items():
        # The new core made exactly the tokens the dead one had not.
        assert cluster.runners[1].fake.given[request_id] == [cluster.token] * 12
        assert prior == [cluster.token] * len(prior)
    assert cluster.counter.restarts == 1
    assert cluster.engine.is_running
    cluster.engine.shutdown()


async def test_while_restarting_degraded_aborts_drop_and_new_requests_wait(
    tokenizer: Any,
) -> None:
    gate = asyncio.Event()
    cluster = Cluster(tokenizer, [3, None], gate=gate)
    engine = cluster.engine
    kept, dropped = cluster.stream("kept"), cluster.stream("dropped")
    await wait_for(lambda: engine.restarting)
    assert not engine.errored and engine.is_running
    await engine.check_health()  # degraded is not dead
    await engine.abort("dropped")
    assert joined(await asyncio.wait_for(dropped, 5))[2] == "abort"
    late = cluster.stream("late", max_tokens=3)
    await asyncio.sleep(0.05)
    gate.set()
    assert joined(await asyncio.wait_for(kept, 10))[0] == "a" * 12
    assert joined(await asyncio.wait_for(late, 10))[0] == "aaa"
    assert set(cluster.resumed_priors(1)) == {"kept", "late"}
    assert cluster.resumed_priors(1)["late"] == []
    engine.shutdown()


async def test_a_core_gone_before_the_output_handler_notices_is_already_degraded(
    tokenizer: Any,
) -> None:
    # A killed core process is seen dead (``is_alive``) a moment before the output
    # handler's read fails and the restart begins: not a moment of "dead" for /health
    # or for a request arriving then.
    cluster = Cluster(tokenizer, [None, None])
    engine = cluster.engine
    client = engine.client
    assert isinstance(client, AsyncInprocClient)
    client._dead = EngineDeadError("the engine core process died")
    assert engine.restarting and not engine.errored and engine.is_running
    await engine.check_health()
    late = await asyncio.wait_for(cluster.stream("late", max_tokens=3), 10)
    assert joined(late)[0] == "aaa"
    assert set(cluster.resumed_priors(1)) == {"late"}
    assert cluster.counter.restarts == 1
    assert not engine.restarting and engine.is_running
    engine.shutdown()


async def test_a_core_that_dies_during_the_replay_is_replaced_again(tokenizer: Any) -> None:
    cluster = Cluster(tokenizer, [4, 0, None])
    streams = [cluster.stream(f"r{i}") for i in range(2)]
    for outputs in await asyncio.wait_for(asyncio.gather(*streams), 10):
        assert joined(outputs)[1] == [cluster.token] * 12
    # The second core died before producing anything: the third resumed the same output.
    second, third = cluster.resumed_priors(1), cluster.resumed_priors(2)
    assert second["r0"] and third["r0"] == second["r0"]
    assert cluster.counter.restarts == 2
    cluster.engine.shutdown()


async def test_once_the_budget_is_spent_the_engine_is_dead(tokenizer: Any) -> None:
    cluster = Cluster(tokenizer, [3, "fail", "fail", None], budget=2)
    stream = cluster.stream("r")
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(stream, 10)
    engine = cluster.engine
    assert engine.errored and not engine.restarting
    with pytest.raises(EngineDeadError):
        await engine.check_health()
    assert engine.supervisor is not None and engine.supervisor.num_restarts == 2
    assert cluster.counter.restarts == 2
    engine.shutdown()
