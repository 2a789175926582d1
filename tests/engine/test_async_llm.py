"""AsyncLLM as an ``EngineClient``, on an EngineCore with a fake runner (no model, no torch):
chat rendering and prompt validation run off the event loop and refuse bad input
before anything is queued."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

import pytest

from tests.engine.fakes import FakeModelRunner
from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.engine.args import EngineArgs
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.core import EngineCore
from tokenloom.engine.core_client import AsyncInprocClient, InprocClient
from tokenloom.engine.exceptions import EngineDeadError
from tokenloom.engine.protocol import ChatOptions, EngineClient
from tokenloom.engine.setup import EngineSetup
from tokenloom.outputs import RequestOutput
from tokenloom.sampling_params import SamplingParams

T = TypeVar("T")
ROLES = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"


@pytest.fixture()
def core(tokenizer: Any) -> EngineCore:
    (token,) = tokenizer.encode("a", add_special_tokens=False)
    return EngineCore(
        FakeModelRunner(num_blocks=64, max_model_len=128, token=token),
        CacheConfig(block_size=4, num_blocks=64),
        SchedulerConfig(),
    )


@pytest.fixture()
def engine(tokenizer: Any, core: EngineCore) -> Iterator[AsyncLLM]:
    args = EngineArgs(max_model_len=128, log_stats=False, max_logprobs=3, chat_template=ROLES)
    setup = EngineSetup.from_engine_args(args)
    engine = AsyncLLM(setup, AsyncInprocClient(InprocClient(core)), tokenizer)
    yield engine
    engine.shutdown()


def nothing_queued(engine: AsyncLLM, core: EngineCore) -> bool:
    return not engine.output_processor.has_unfinished_requests() and not core.has_work()


async def collect(engine: EngineClient, prompt: Any, params: SamplingParams) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, "r")]


async def test_render_chat_then_generate(engine: AsyncLLM) -> None:
    client: EngineClient = engine  # what the server codes against
    rendered = await client.render_chat([{"role": "user", "content": "Hi"}], ChatOptions())
    assert rendered.text == "user:Hi;"  # the engine's --chat-template
    own = ChatOptions(chat_template="{{ tone }}|" + ROLES, chat_template_kwargs={"tone": "dry"})
    assert (await client.render_chat([{"role": "user", "content": "Hi"}], own)).text == (
        "dry|user:Hi;"
    )
    outs = await collect(client, rendered.token_ids, SamplingParams(max_tokens=3, ignore_eos=True))
    final = outs[-1]
    assert final.finished and final.prompt_token_ids == rendered.token_ids
    assert final.outputs[0].text == "aaa"


@pytest.mark.parametrize(
    ("messages", "options", "field"),
    [
        ([{"role": "user", "content": "x\udc00"}], ChatOptions(), "messages"),
        ([], ChatOptions(), "messages"),
        (
            [{"role": "user", "content": "Hi"}],
            ChatOptions(chat_template="{% if %}"),
            "chat_template",
        ),
        (
            [{"role": "user", "content": "Hi"}],
            ChatOptions(chat_template_kwargs={"add_generation_prompt": 1}),
            "chat_template_kwargs",
        ),
    ],
)
async def test_render_chat_errors_name_the_field(
    engine: AsyncLLM, messages: Any, options: ChatOptions, field: str
) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        await engine.render_chat(messages, options)


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("caf\udce9", SamplingParams(), "^prompt contains a lone surrogate"),
        ("Hi", SamplingParams(logprobs=4), r"^logprobs \(4\) exceeds .* 3 \(max_logprobs\)"),
        ("", SamplingParams(), "^prompt must not be empty"),
        ([1, 10**6], SamplingParams(), "outside the vocabulary"),
    ],
)
async def test_invalid_requests_are_refused_before_anything_is_queued(
    engine: AsyncLLM, core: EngineCore, prompt: Any, params: SamplingParams, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        await collect(engine, prompt, params)
    assert nothing_queued(engine, core)
    outs = await collect(engine, "Hi", SamplingParams(max_tokens=2, ignore_eos=True, logprobs=None))
    assert outs[-1].finished


async def max_loop_stall(work: Awaitable[T]) -> tuple[float, float]:
    """Run ``work``; return (how long it took, the longest the event loop was stalled)."""
    stalls: list[float] = []
    done = False

    async def ticker() -> None:
        last = time.monotonic()
        while not done:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            stalls.append(now - last)
            last = now

    task = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.02)
    started = time.monotonic()
    try:
        await work
    except ValueError:
        pass
    took = time.monotonic() - started
    done = True
    await task
    return took, max(stalls)


async def test_a_huge_prompt_does_not_block_the_event_loop(
    engine: AsyncLLM, core: EngineCore
) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 16_000  # 720 kB
    took, stall = await max_loop_stall(
        collect(engine, prompt, SamplingParams(max_tokens=1))  # too long: refused
    )
    assert took > 0.1, "tokenizing took no time: the test proves nothing"
    assert stall < took / 2, f"event loop stalled {stall:.2f}s of {took:.2f}s"
    assert nothing_queued(engine, core)


async def test_a_slow_chat_template_does_not_block_the_event_loop(engine: AsyncLLM) -> None:
    slow = "{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}x"
    took, stall = await max_loop_stall(
        engine.render_chat([{"role": "user", "content": "Hi"}], ChatOptions(chat_template=slow))
    )
    assert took > 0.1, "rendering took no time: the test proves nothing"
    assert stall < took / 2, f"event loop stalled {stall:.2f}s of {took:.2f}s"


async def test_after_shutdown_everything_raises_engine_dead(engine: AsyncLLM) -> None:
    engine.shutdown()
    with pytest.raises(EngineDeadError):
        await engine.render_chat([{"role": "user", "content": "Hi"}], ChatOptions())
    with pytest.raises(EngineDeadError):
        await collect(engine, "Hi", SamplingParams(max_tokens=1))
    with pytest.raises(EngineDeadError):
        await engine.check_health()
