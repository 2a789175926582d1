"""AsyncLLM end to end, with the core in this process and in its own process.

The in-process engine shares the session's ``LLM`` core (one model load fewer);
the multiprocess one is built by ``from_engine_args`` like the server does. The
last test kills the engine process, so it runs last in this module.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import ENGINE_KWARGS
from tokenloom import SamplingParams
from tokenloom.engine.args import EngineArgs
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.exceptions import EngineDeadError
from tokenloom.outputs import RequestOutput

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

KINDS = ["async_inproc", "async_mp"]
PROMPT = "Write a long story about a dragon."


@pytest.fixture(scope="module")
def async_inproc(default_model_path: Path) -> Any:
    # Its own core: shutting the engine down shuts its core down too, which must
    # not be the session's shared ``llm``.
    engine = AsyncLLM.from_engine_args(
        EngineArgs(model=str(default_model_path), **ENGINE_KWARGS), multiprocess=False
    )
    assert engine.engine_core_pid is None
    yield engine
    engine.shutdown()
    assert not engine.is_running


@pytest.fixture(scope="module")
def async_mp(default_model_path: Path) -> Any:
    # No restarts: the last test checks what a dead core means (test_crash_recovery_e2e
    # covers restarts).
    args = EngineArgs(model=str(default_model_path), max_engine_restarts=0, **ENGINE_KWARGS)
    engine = AsyncLLM.from_engine_args(args)
    assert engine.engine_core_pid is not None and engine.engine_core_pid != os.getpid()
    yield engine
    engine.shutdown()
    assert not engine.is_running


def get_engine(request: pytest.FixtureRequest, kind: str) -> AsyncLLM:
    return request.getfixturevalue(kind)


async def collect(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [out async for out in stream]


async def wait_until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def kv_released(engine: AsyncLLM) -> bool:
    stats = engine.latest_scheduler_stats
    return stats is not None and stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0


@pytest.mark.parametrize("kind", KINDS)
async def test_stream_deltas_concatenate_to_final_text(
    request: pytest.FixtureRequest, kind: str
) -> None:
    engine = get_engine(request, kind)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    deltas = await collect(engine.generate(PROMPT, params, f"delta-{kind}", delta=True))
    cumulative = await collect(engine.generate(PROMPT, params, f"cumulative-{kind}"))
    final = cumulative[-1].outputs[0]
    assert len(deltas) > 1 and deltas[-1].finished and not deltas[0].finished
    assert cumulative[-1].finished and len(final.token_ids) == 6
    assert "".join(d.outputs[0].text for d in deltas) == final.text
    assert [t for d in deltas for t in d.outputs[0].token_ids] == final.token_ids
    # Cumulative outputs only grow.
    texts = [c.outputs[0].text for c in cumulative]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))


@pytest.mark.parametrize("kind", KINDS)
async def test_stop_string_never_leaks_into_stream(
    request: pytest.FixtureRequest, kind: str
) -> None:
    engine = get_engine(request, kind)
    free = await collect(
        engine.generate(
            PROMPT,
            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
            f"free-{kind}",
        )
    )
    words = free[-1].outputs[0].text.split()
    assert len(words) >= 4, free[-1].outputs[0]
    stop = words[3]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, stop=stop)
    deltas = await collect(engine.generate(PROMPT, params, f"stop-{kind}", delta=True))
    text = "".join(d.outputs[0].text for d in deltas)
    last = deltas[-1].outputs[0]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert stop not in text and free[-1].outputs[0].text.startswith(text)
    await wait_until(lambda: kv_released(engine), 30)


@pytest.mark.parametrize("kind", KINDS)
async def test_n_streams(request: pytest.FixtureRequest, kind: str) -> None:
    engine = get_engine(request, kind)
    params = SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=1, ignore_eos=True)
    deltas = await collect(engine.generate("Once upon a time", params, f"n-{kind}", delta=True))
    tokens: dict[int, list[int]] = {0: [], 1: []}
    for out in deltas:
        for completion in out.outputs:
            tokens[completion.index] += completion.token_ids
    assert deltas[-1].finished and all(len(t) == 3 for t in tokens.values())


@pytest.mark.parametrize("kind", KINDS)
async def test_consumer_leaving_aborts_and_frees_kv(
    request: pytest.FixtureRequest, kind: str
) -> None:
    engine = get_engine(request, kind)
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    stream = engine.generate(PROMPT, params, f"leave-{kind}")
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 2:
            break
    await stream.aclose()
    await wait_until(lambda: kv_released(engine), 30)
    assert engine.num_running_requests == 0

    # An explicit abort ends the stream of a consumer that is still waiting.
    stream = engine.generate(PROMPT, params, f"abort-{kind}")
    await stream.__anext__()
    consumer = asyncio.ensure_future(collect(stream))
    await engine.abort(f"abort-{kind}")
    rest = await asyncio.wait_for(consumer, 30)
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    await wait_until(lambda: kv_released(engine), 30)


@pytest.mark.parametrize("kind", KINDS)
async def test_invalid_requests_raise_value_error(
    request: pytest.FixtureRequest, kind: str
) -> None:
    engine = get_engine(request, kind)
    with pytest.raises(ValueError, match="empty"):
        await collect(engine.generate("", SamplingParams(), f"bad-{kind}"))
    with pytest.raises(ValueError, match="vocabulary"):
        await collect(engine.generate([1, 10**7], SamplingParams(), f"bad-{kind}"))
    with pytest.raises(ValueError, match="max_tokens"):
        await collect(engine.generate("Hi", SamplingParams(max_tokens=512), f"bad-{kind}"))
    long_stream = engine.generate(
        PROMPT, SamplingParams(max_tokens=200, ignore_eos=True), f"dup-{kind}"
    )
    assert not (await long_stream.__anext__()).finished
    with pytest.raises(ValueError, match="already in use"):
        await collect(engine.generate("Hi", SamplingParams(), f"dup-{kind}"))
    await long_stream.aclose()
    outs = await collect(
        engine.generate("Hi", SamplingParams(max_tokens=2, ignore_eos=True), f"ok-{kind}")
    )
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 2
    await engine.check_health()
    assert engine.is_running and not engine.errored


async def test_many_concurrent_requests(async_mp: AsyncLLM) -> None:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    count = 200
    results = await asyncio.gather(
        *(collect(async_mp.generate([1 + i % 50, 2], params, f"many-{i}")) for i in range(count))
    )
    finals = [r[-1] for r in results]
    assert [f.request_id for f in finals] == [f"many-{i}" for i in range(count)]
    assert all(f.finished and len(f.outputs[0].token_ids) == 2 for f in finals)
    # Same prompt, greedy: same tokens whatever the batch.
    assert finals[0].outputs[0].token_ids == finals[50].outputs[0].token_ids
    await wait_until(lambda: kv_released(async_mp), 30)


async def test_idle_engine_process_does_not_spin(async_mp: AsyncLLM) -> None:
    import psutil

    assert async_mp.engine_core_pid is not None
    process = psutil.Process(async_mp.engine_core_pid)
    await asyncio.sleep(0.5)  # let the last step's work settle
    before = process.cpu_times()
    await asyncio.sleep(2.0)
    after = process.cpu_times()
    used = (after.user - before.user) + (after.system - before.system)
    assert used < 0.2, f"idle engine core used {used:.2f}s of CPU in 2s"


async def test_killed_engine_process_fails_requests_fast(async_mp: AsyncLLM) -> None:
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    stream = async_mp.generate(PROMPT, params, "victim")
    await asyncio.wait_for(stream.__anext__(), 120)
    assert async_mp.engine_core_pid is not None
    os.kill(async_mp.engine_core_pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(collect(stream), 10)
    assert time.monotonic() - started < 10
    assert async_mp.errored and not async_mp.is_running
    with pytest.raises(EngineDeadError):
        await async_mp.check_health()
    with pytest.raises(EngineDeadError):
        await collect(async_mp.generate("Hi", SamplingParams(), "after-death"))
