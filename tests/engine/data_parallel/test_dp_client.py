"""``DPClient`` over two engine cores (scheduler + a runner without a model, stepped in
threads), and KV events from a real publisher reaching the router over ZMQ."""

from __future__ import annotations

import asyncio
import tempfile
import time

import pytest
import zmq

from tests.engine.fakes import FakeModelRunner
from tokenloom.config import CacheConfig, DPLoadBalanceConfig, SchedulerConfig
from tokenloom.core.kv_cache.events import BlockStored
from tokenloom.core.kv_cache.hashing import prompt_block_digests
from tokenloom.engine.core import EngineCore
from tokenloom.engine.core_client import AsyncInprocClient, InprocClient
from tokenloom.engine.data_parallel.client import DPClient, KVEventSubscriber
from tokenloom.engine.data_parallel.router import Router
from tokenloom.engine.exceptions import CoreDeadError, EngineDeadError
from tokenloom.engine.kv_events import KVEventPublisher
from tokenloom.engine.messages import EngineCoreRequest
from tokenloom.sampling_params import SamplingParams

BS = 4


def make_core() -> EngineCore:
    return EngineCore(
        FakeModelRunner(num_blocks=64), CacheConfig(block_size=BS, num_blocks=64), SchedulerConfig()
    )


def make_client(policy: str = "round_robin") -> tuple[DPClient, list[EngineCore]]:
    cores = [make_core(), make_core()]
    clients = [AsyncInprocClient(InprocClient(core)) for core in cores]
    router = Router(2, DPLoadBalanceConfig(policy=policy), BS)  # type: ignore[arg-type]
    return DPClient(list(clients), router), cores  # type: ignore[arg-type]


def request(request_id: str, max_tokens: int = 3) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id, list(range(10)), SamplingParams(max_tokens=max_tokens), None, time.time()
    )


async def drain(client: DPClient, request_ids: set[str]) -> dict[str, tuple[int, int]]:
    """request id -> (engine that produced it, tokens) until all are finished."""
    done: dict[str, tuple[int, int]] = {}
    counts: dict[str, int] = {}
    while set(done) != request_ids:
        result = await asyncio.wait_for(client.get_output(), 10)
        for output in result.outputs.outputs:
            counts[output.request_id] = counts.get(output.request_id, 0) + len(output.new_token_ids)
            if output.finished:
                done[output.request_id] = (result.engine_index, counts[output.request_id])
    return done


async def test_outputs_come_back_tagged_with_their_core_and_loads_drop() -> None:
    client, _ = make_client()
    client.add_requests([request(f"r{i}") for i in range(4)])
    assert client.router.loads == [2, 2]
    done = await drain(client, {f"r{i}" for i in range(4)})
    assert {engine for engine, _ in done.values()} == {0, 1}
    assert all(tokens == 3 for _, tokens in done.values())
    assert client.router.loads == [0, 0]
    client.shutdown()


async def test_abort_goes_to_the_owning_core_only() -> None:
    client, cores = make_client()
    client.add_requests([request("a", 50), request("b", 50)])
    owner_a = client.router.owner("a")
    assert owner_a is not None
    await client.get_output()
    client.abort_requests(["a"])
    assert client.router.loads[owner_a] == 0
    done = await drain(client, {"b"})
    assert done["b"] == (1 - owner_a, 50)  # the other core's request ran to the end
    assert "a" not in cores[owner_a].scheduler.requests
    client.shutdown()


async def test_resubmit_moves_requests_off_the_excluded_core() -> None:
    client, cores = make_client()
    requests = [request(f"r{i}") for i in range(4)]
    client.resubmit(requests, exclude_core=0)
    assert client.router.loads == [0, 4]
    done = await drain(client, {r.request_id for r in requests})
    assert {engine for engine, _ in done.values()} == {1}
    assert not cores[0].scheduler.requests
    client.shutdown()


async def test_a_dead_core_is_named_and_leaves_routing() -> None:
    client, cores = make_client()

    def broken(*args: object) -> None:
        raise RuntimeError("boom")

    cores[1].runner.execute_model = broken  # type: ignore[method-assign]
    client.add_requests([request("a", 50), request("b")])  # "a" outlives core 1
    with pytest.raises(CoreDeadError, match="boom") as info:
        await drain(client, {"a", "b"})
    assert info.value.engine_index == 1
    assert client.is_alive() and not client.restarting  # core 0 still serves; no supervisors
    assert client.release_core(1) == ["b"] and client.router.loads[1] == 0
    assert not client.restart_core(1, "boom")
    client.add_requests([request("c"), request("d")])  # round robin skips the dead core
    assert client.router.owner("c") == client.router.owner("d") == 0
    assert set(await drain(client, {"a", "c", "d"})) == {"a", "c", "d"}
    cores[0].runner.execute_model = broken  # type: ignore[method-assign]
    client.add_requests([request("e")])
    with pytest.raises(CoreDeadError):
        await drain(client, {"e"})
    assert not client.is_alive()
    with pytest.raises(EngineDeadError, match="every engine core is dead"):
        await client.get_output()
    client.shutdown()


async def test_published_events_reach_the_router() -> None:
    client, _ = make_client(policy="prefix")
    with tempfile.TemporaryDirectory() as tmp:
        events = KVEventSubscriber(f"ipc://{tmp}/events")
        client._events = events
        context = zmq.Context()
        publisher = KVEventPublisher(context, events.address, data_parallel_rank=1)
        tokens = list(range(100, 100 + 3 * BS))
        digests = prompt_block_digests(tokens, BS)
        stored = BlockStored(digests, None, tokens, BS, None)
        # PUB drops what it sends before the subscription arrives: publish until seen.
        deadline = time.monotonic() + 10
        while client.router.route("probe", tokens + [0]) != 1:
            client.router.release("probe")
            client.router.forget_engine(0)
            assert time.monotonic() < deadline, "events never arrived"
            publisher.publish([stored])
            try:
                await asyncio.wait_for(client.get_output(), 0.2)
            except asyncio.TimeoutError:
                pass
        publisher.close()
        context.term()
        client.shutdown()
