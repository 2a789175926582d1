"""``AsyncLLM`` with two real engine core processes: KV events from the cores reach the
router, aborts free the owning core, greedy outputs match across cores."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenloom.config import DPLoadBalanceConfig
from tokenloom.core.kv_cache.hashing import prompt_block_digests
from tokenloom.engine.args import EngineArgs
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.data_parallel.client import DPClient
from tokenloom.sampling_params import SamplingParams

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def engine(default_model_path: Path) -> Iterator[AsyncLLM]:
    args = EngineArgs(
        model=str(default_model_path),
        data_parallel_size=2,
        num_blocks=128,
        max_model_len=512,
        log_stats=False,
    )
    engine = AsyncLLM.from_engine_args(args)
    yield engine
    engine.shutdown()


async def generate(engine: AsyncLLM, prompt: list[int], request_id: str, n: int) -> list[int]:
    final = None
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    async for output in engine.generate(prompt, params, request_id):
        final = output
    assert final is not None and final.finished
    return list(final.outputs[0].token_ids)


async def test_core_events_reach_the_router_and_aborts_free_the_owner(engine: AsyncLLM) -> None:
    client = engine.client
    assert isinstance(client, DPClient)
    assert len(set(client.engine_core_pids)) == 2
    prompt = engine.tokenizer.encode("The history of the printing press, in brief: " * 6)
    await generate(engine, prompt, "a", 4)
    digests = prompt_block_digests(prompt, engine.engine_args.block_size)
    deadline = time.monotonic() + 30
    while True:
        holders = [i for i in range(2) if set(digests) <= client.router.stored_blocks(i)]
        if holders:
            break
        assert time.monotonic() < deadline, "the core's BlockStored events never arrived"
        await asyncio.sleep(0.1)
    # A stream closed early is aborted in the core that owns it; the load drops back.
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    stream = engine.generate(prompt + [13], params, "long")
    async for _ in stream:
        break
    await stream.aclose()
    assert client.router.loads == [0, 0]
    assert client.router.owner("long") is None


async def test_the_same_prompt_gives_the_same_tokens_on_either_core(engine: AsyncLLM) -> None:
    client = engine.client
    assert isinstance(client, DPClient)
    client.router.config = DPLoadBalanceConfig(policy="round_robin")  # alternate the cores
    prompt = engine.tokenizer.encode("Three facts about the moon:")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs, owners = [], []
    for i in range(2):
        final = None
        async for output in engine.generate(prompt, params, f"same{i}"):
            if final is None:
                owners.append(client.router.owner(f"same{i}"))
            final = output
        assert final is not None
        outputs.append(final.outputs[0].token_ids)
    assert sorted(owners) == [0, 1]  # type: ignore[type-var]
    assert outputs[0] == outputs[1]
