"""Data parallel failover end to end: two engine cores on the real model in float32
(local processes, or Ray actors on a local Ray instance), 32 greedy streams, and one
core's process SIGKILLed mid-stream. Its streams must move to the other core at once
and every stream finish with exactly the tokens of a run without the crash; the killed
core must restart (a Ray core as a new actor) and take requests again."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.engine.fakes import RestartCounter
from tests.engine.test_crash_recovery_e2e import NUM_STREAMS, Run, wait_until
from tokenloom import SamplingParams
from tokenloom.engine.args import EngineArgs
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.data_parallel.client import DPClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900), pytest.mark.asyncio(loop_scope="module")]

MAX_TOKENS = 20


def greedy(_: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["mp", "ray"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def counter(backend: str) -> RestartCounter:
    return RestartCounter()


@pytest.fixture(scope="module")
def engine(default_model_path: Path, backend: str, counter: RestartCounter) -> Iterator[AsyncLLM]:
    args = EngineArgs(
        model=str(default_model_path),
        dtype="float32",
        num_blocks=256,
        max_model_len=256,
        log_stats=False,
        data_parallel_size=2,
        data_parallel_backend=backend,
        max_engine_restarts=1,
        engine_restart_backoff_s=0.05,
    )
    engine = AsyncLLM.from_engine_args(args, stat_loggers=[counter])
    yield engine
    engine.shutdown()
    if backend == "ray":
        import ray

        ray.shutdown()  # the local instance this process started


def dp_client(engine: AsyncLLM) -> DPClient:
    assert isinstance(engine.client, DPClient)
    return engine.client


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(engine: AsyncLLM) -> list[list[int]]:
    tokens = await Run(engine, "reference", greedy).finish()
    assert all(len(t) == MAX_TOKENS for t in tokens)
    return tokens


async def test_sigkill_one_core_its_streams_fail_over_and_it_comes_back(
    engine: AsyncLLM, reference: list[list[int]], counter: RestartCounter
) -> None:
    client = dp_client(engine)
    run = Run(engine, "crash", greedy)
    await wait_until(run.all_started, 300, "every stream's first tokens")
    on_core_1 = client.router.loads[1]
    assert on_core_1 > 0 and client.router.loads[0] > 0  # both cores serve the streams
    killed = client.engine_core_pids[1]
    assert killed is not None
    old_core = client.clients[1]
    os.kill(killed, signal.SIGKILL)
    streamed_before = sum(len(t) for t in run.tokens)
    await wait_until(lambda: engine.restarting, 30, "the engine to notice the dead core")
    # Degraded, not dead, and the dead core's streams already run on core 0.
    assert not engine.errored and engine.is_running
    await engine.check_health()
    assert client.router.loads[1] == 0
    assert client.router.loads[0] >= on_core_1 or all(len(t) == MAX_TOKENS for t in run.tokens)
    tokens = await run.finish()
    assert streamed_before >= 2 * NUM_STREAMS  # the crash hit streams in mid-flight
    for i in range(NUM_STREAMS):
        assert tokens[i] == reference[i], f"stream {i} differs after the failover"
    await wait_until(lambda: not engine.restarting, 300, "core 1 to restart")
    assert client.engine_core_pids[1] not in (None, killed) and engine.is_running
    assert client.clients[1] is not old_core and not old_core.is_alive()
    assert counter.restarts == 1
    # Core 1 is back in routing and serves the same tokens.
    again = Run(engine, "again", greedy)
    await wait_until(again.all_started, 300, "the next run's first tokens")
    assert client.router.loads[1] > 0
    assert await again.finish() == reference


async def test_a_core_whose_loop_fails_is_replaced(
    engine: AsyncLLM, reference: list[list[int]], counter: RestartCounter
) -> None:
    """A core loop that raises reports the error and returns. A Ray actor then lives on,
    holding its bundle, so the replacement can only be placed once it is killed."""
    client = dp_client(engine)
    old_pid = client.engine_core_pids[0]
    old_core = client.clients[0]
    old_core._input.send(b"\xc1")  # type: ignore[attr-defined]  # not msgpack: the loop raises
    await wait_until(lambda: client.clients[0] is not old_core, 300, "core 0 to be replaced")
    await wait_until(lambda: not engine.restarting, 300, "core 0 to restart")
    assert client.engine_core_pids[0] not in (None, old_pid) and engine.is_running
    assert counter.restarted_engines[-1] == 0
    run = Run(engine, "after-error", greedy)
    await wait_until(run.all_started, 300, "the next run's first tokens")
    assert client.router.loads[0] > 0 and client.router.loads[1] > 0
    assert await run.finish() == reference
