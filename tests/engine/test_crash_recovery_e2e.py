"""Crash recovery end to end: SIGKILL the engine core while 32 streams run, on the
real model in float32. Every stream must finish with exactly the tokens of a run
without the crash, greedy and seeded sampled alike (penalties included), and the
engine must be degraded, not dead, while the core restarts.

The engine allows three restarts: one for the single crash, two for a core that is
killed again while it replays; then the budget is spent and a crash is final.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.engine.fakes import RestartCounter
from tokenloom import SamplingParams
from tokenloom.engine.args import EngineArgs
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.exceptions import EngineDeadError

# One event loop for the module: the reference run is a module fixture.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900), pytest.mark.asyncio(loop_scope="module")]

NUM_STREAMS = 32
MAX_TOKENS = 32


def params(i: int) -> SamplingParams:
    """Even streams greedy, odd ones seeded sampling; every fourth with penalties."""
    penalties: dict[str, Any] = {}
    if i % 4 >= 2:
        penalties = {"presence_penalty": 0.4, "frequency_penalty": 0.3, "repetition_penalty": 1.2}
    if i % 2 == 0:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **penalties)
    return SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.9,
        top_p=0.95,
        seed=1000 + i,
        ignore_eos=True,
        **penalties,
    )


PROMPTS = [f"Write a short note about topic {i}: the sea, ships and sailors." for i in range(32)]


@pytest.fixture(scope="module")
def counter() -> RestartCounter:
    return RestartCounter()


@pytest.fixture(scope="module")
def engine(default_model_path: Path, counter: RestartCounter) -> Any:
    args = EngineArgs(
        model=str(default_model_path),
        dtype="float32",
        num_blocks=512,
        max_model_len=512,
        log_stats=False,
        max_engine_restarts=3,
        engine_restart_backoff_s=0.05,
    )
    engine = AsyncLLM.from_engine_args(args, stat_loggers=[counter])
    yield engine
    engine.shutdown()


class Run:
    """32 concurrent streams sampled by ``params(i)``; ``tokens[i]`` grows with its deltas."""

    def __init__(
        self, engine: AsyncLLM, tag: str, params: Callable[[int], SamplingParams] = params
    ) -> None:
        self.engine = engine
        self.params = params
        self.tokens: list[list[int]] = [[] for _ in range(NUM_STREAMS)]
        self.tasks = [
            asyncio.ensure_future(self._stream(i, f"{tag}-{i}")) for i in range(NUM_STREAMS)
        ]

    async def _stream(self, i: int, request_id: str) -> None:
        request = self.engine.generate(PROMPTS[i], self.params(i), request_id, delta=True)
        async for out in request:
            self.tokens[i] += out.outputs[0].token_ids
            if out.finished:
                assert out.outputs[0].finish_reason == "length"

    def all_started(self) -> bool:
        return all(len(t) >= 2 for t in self.tokens)

    async def finish(self) -> list[list[int]]:
        await asyncio.wait_for(asyncio.gather(*self.tasks), 600)
        return self.tokens


async def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(engine: AsyncLLM) -> list[list[int]]:
    tokens = await Run(engine, "reference").finish()
    assert all(len(t) == MAX_TOKENS for t in tokens)
    return tokens


async def kill_core(engine: AsyncLLM) -> int:
    pid = engine.engine_core_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    return pid


async def crash_midway(engine: AsyncLLM, tag: str) -> tuple[Run, int]:
    """32 streams; the core is killed once each has its first tokens. Returns the dead pid."""
    run = Run(engine, tag)
    await wait_until(run.all_started, 300, "every stream's first tokens")
    return run, await kill_core(engine)


async def test_sigkill_during_32_streams_loses_nothing(
    engine: AsyncLLM, reference: list[list[int]], counter: RestartCounter
) -> None:
    run, killed = await crash_midway(engine, "crash")
    streamed_before = sum(len(t) for t in run.tokens)
    await wait_until(lambda: engine.restarting, 30, "the engine to notice the dead core")
    # Degraded, not dead: health passes and new requests are accepted meanwhile.
    assert not engine.errored and engine.is_running
    await engine.check_health()
    late = asyncio.ensure_future(
        engine.generate(PROMPTS[0], params(0), "late", delta=False).__anext__()
    )
    tokens = await run.finish()
    assert not engine.restarting and engine.is_running
    await engine.check_health()
    assert engine.engine_core_pid not in (None, killed)
    assert counter.restarts == 1
    assert streamed_before >= 2 * NUM_STREAMS  # the crash hit streams in mid-flight
    for i in range(NUM_STREAMS):
        assert tokens[i] == reference[i], f"stream {i} ({params(i)}) differs after the crash"
    first_late = await asyncio.wait_for(late, 300)
    assert first_late.outputs[0].token_ids == reference[0][: len(first_late.outputs[0].token_ids)]


async def test_a_core_killed_again_during_replay(
    engine: AsyncLLM, reference: list[list[int]], counter: RestartCounter
) -> None:
    run, first = await crash_midway(engine, "twice")
    # The replacement is killed as soon as it is ready: while it recomputes the replay.
    await wait_until(lambda: engine.engine_core_pid != first, 300, "the first restart")
    await kill_core(engine)
    tokens = await run.finish()
    assert counter.restarts == 3
    for i in range(NUM_STREAMS):
        assert tokens[i] == reference[i], f"stream {i} differs after two crashes"


async def test_once_the_budget_is_spent_a_crash_is_final(engine: AsyncLLM) -> None:
    run, _ = await crash_midway(engine, "final")
    with pytest.raises(EngineDeadError):
        await run.finish()
    assert engine.errored and not engine.restarting
    with pytest.raises(EngineDeadError):
        await engine.check_health()
