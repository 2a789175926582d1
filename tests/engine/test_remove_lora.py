"""An unloaded adapter's weights are dropped by the runner, whichever client
carries the message (in process, or msgpack to the core process)."""

from __future__ import annotations

import asyncio

from tests.engine.fakes import FakeModelRunner
from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.engine.core import EngineCore
from tokenloom.engine.core_client import AsyncInprocClient, InprocClient
from tokenloom.engine.messages import RemoveLoRA, encode, input_decoder


def _core() -> tuple[EngineCore, FakeModelRunner]:
    runner = FakeModelRunner(num_blocks=16)
    return EngineCore(runner, CacheConfig(block_size=4, num_blocks=16), SchedulerConfig()), runner


def test_remove_lora_reaches_the_runner() -> None:
    core, runner = _core()
    InprocClient(core).remove_lora(5)
    assert ("remove_lora", 5) in runner.calls
    assert input_decoder.decode(encode(RemoveLoRA(7))) == RemoveLoRA(7)


def test_async_inproc_client_applies_it_in_the_step_thread() -> None:
    core, runner = _core()
    client = AsyncInprocClient(InprocClient(core))
    client.remove_lora(3)
    assert ("remove_lora", 3) not in runner.calls  # queued, not applied on this thread
    asyncio.run(asyncio.to_thread(client._run_step))
    assert ("remove_lora", 3) in runner.calls
