"""The disk KV tier survives a crashed engine core: SIGKILL the core after it saved
a long prompt's blocks, let crash recovery start a new core process on the same
``--kv-offload-dir``, and ask the same prompt again; then kill the core while it
streams that prompt's answer. A new core holds nothing in memory, so every full
block before the prompt's last token must come from the disk (the request's
``num_cached_tokens`` and the connector's hit counter, which feeds
``tokenloom:external_prefix_cache_hits_total``), and the greedy answer must be the
one the first core gave."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.fakes import RestartCounter
from tokenloom import SamplingParams
from tokenloom.engine.args import EngineArgs
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.kv_transfer.block_file import BLOCKS_DIR
from tokenloom.metrics.stats import IterationStats
from tokenloom.outputs import KVTransferStats, RequestOutput, SchedulerStats

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

BLOCK_SIZE = 16
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


class Collector(RestartCounter):
    """Counts restarts, and sums the scheduler's prefix cache and KV connector stats."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVTransferStats()
        self.hits = 0

    def record(self, scheduler: SchedulerStats | None, iteration: IterationStats | None) -> None:
        super().record(scheduler, iteration)
        if scheduler is None:
            return
        self.hits += scheduler.prefix_cache_hits
        if scheduler.kv_transfer_stats is not None:
            self.kv.merge(scheduler.kv_transfer_stats)


@pytest.fixture(scope="module")
def collector() -> Collector:
    return Collector()


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv_tier")


@pytest.fixture(scope="module")
def engine(default_model_path: Path, tier: Path, collector: Collector) -> Iterator[AsyncLLM]:
    args = EngineArgs(
        model=str(default_model_path),
        num_blocks=64,
        max_model_len=1024,
        log_stats=False,
        kv_offload_dir=str(tier),
        max_engine_restarts=2,
        engine_restart_backoff_s=0.05,
    )
    engine = AsyncLLM.from_engine_args(args, stat_loggers=[collector])
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompt(tokenizer: Any) -> list[int]:
    """About 300 tokens: 18 full blocks and a partial one."""
    ids = tokenizer.encode(inspect.getdoc(json) or "", add_special_tokens=False)[:300]
    assert len(ids) == 300
    return list(ids)


async def generate(engine: AsyncLLM, prompt: list[int], request_id: str) -> RequestOutput:
    final = None
    async for out in engine.generate(prompt, GREEDY, request_id):
        final = out
    assert final is not None and final.finished
    return final


async def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def files_in(tier: Path) -> int:
    return sum(1 for _ in (tier / BLOCKS_DIR).glob("*/*"))


async def kill_core(engine: AsyncLLM) -> int:
    pid = engine.engine_core_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    await wait_until(lambda: engine.restarting, 30, "the engine to notice the dead core")
    return pid


def full_blocks_before_last_token(prompt: list[int]) -> int:
    """Tokens a tier hit covers: full blocks only, and the last prompt token is
    always computed."""
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.fixture(scope="module")
def answer() -> list[list[int]]:
    """The first core's greedy answer, once the first test got it."""
    return []


async def test_a_core_restarted_after_a_crash_loads_the_prompt_from_disk(
    engine: AsyncLLM, tier: Path, prompt: list[int], collector: Collector, answer: list[list[int]]
) -> None:
    first = await generate(engine, prompt, "before")
    assert first.num_cached_tokens == 0
    answer.append(first.outputs[0].token_ids)
    # The saver writes in the background; a block is on disk once its file is renamed
    # into place. Every full block of the prompt, at least, must be there.
    num_full = len(prompt) // BLOCK_SIZE
    await wait_until(lambda: files_in(tier) >= num_full, 30, "the prompt's blocks on disk")

    dead = await kill_core(engine)
    await wait_until(lambda: not engine.restarting, 120, "the new core")
    assert engine.is_running and engine.engine_core_pid not in (None, dead)
    assert collector.restarts == 1

    hits, loaded = collector.hits, collector.kv.num_hit_tokens
    second = await generate(engine, prompt, "after")
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    on_disk = full_blocks_before_last_token(prompt)
    assert second.num_cached_tokens == on_disk
    assert collector.kv.num_hit_tokens - loaded == on_disk
    assert collector.hits == hits  # nothing came from the new core's memory
    assert not collector.kv.errors


async def test_a_request_resumed_after_a_crash_loads_its_prompt_from_disk(
    engine: AsyncLLM, prompt: list[int], collector: Collector, answer: list[list[int]]
) -> None:
    assert answer, "needs the first test's answer"
    tokens: list[int] = []

    async def stream() -> None:
        async for out in engine.generate(prompt, GREEDY, "during", delta=True):
            tokens.extend(out.outputs[0].token_ids)

    task = asyncio.ensure_future(stream())
    await wait_until(lambda: len(tokens) >= 2, 60, "the first tokens")
    loaded = collector.kv.num_hit_tokens
    dead = await kill_core(engine)
    streamed = len(tokens)
    await asyncio.wait_for(task, 120)
    assert engine.engine_core_pid not in (None, dead) and collector.restarts == 2
    assert streamed < GREEDY.max_tokens  # the core died mid-stream
    assert tokens == answer[0]
    # The new core recomputed the prompt and the tokens so far from the disk's blocks.
    assert collector.kv.num_hit_tokens - loaded >= full_blocks_before_last_token(prompt)
    assert not collector.kv.errors
