"""Data parallel failover without a model: when one of two cores dies, its streams
resume on the other at once while it restarts in the background, then it rejoins
routing (cores over a fake runner that can be told to fail at a given step)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import pytest

from tests.engine.fakes import DyingRunner, RestartCounter
from tests.engine.test_recovery import dying_core, joined, resumed_priors, stream, wait_for
from tokenloom.config import DPLoadBalanceConfig, RecoveryConfig
from tokenloom.engine.args import EngineArgs
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.core_client import AsyncInprocClient
from tokenloom.engine.data_parallel.client import CoreClient, DPClient
from tokenloom.engine.data_parallel.router import Router
from tokenloom.engine.exceptions import EngineDeadError
from tokenloom.engine.setup import EngineSetup
from tokenloom.engine.supervisor import CoreSupervisor
from tokenloom.metrics.stats import IterationStats, engine_state
from tokenloom.outputs import RequestOutput, SchedulerStats


class DPCluster:
    """An AsyncLLM over two cores that live ``plans[i]`` steps, counted from the step
    that brings a core its ``after_requests``-th request; a restarted core ``i`` lives
    ``restart_plans[i]`` steps ("fail": it never starts). ``gate``: restarts wait."""

    def __init__(
        self,
        tokenizer: Any,
        plans: list[int | None],
        restart_plans: list[list[Any]] | None,
        gate: asyncio.Event | None = None,
        after_requests: int = 0,
    ) -> None:
        (self.token,) = tokenizer.encode("a", add_special_tokens=False)
        self.runners: list[list[DyingRunner]] = [[] for _ in plans]
        supervisors: list[CoreSupervisor[CoreClient]] | None = None
        if restart_plans is not None:
            config = RecoveryConfig(max_engine_restarts=2, engine_restart_backoff_s=0.0)
            supervisors = [
                CoreSupervisor(config, self.starter(i, iter(p)))
                for i, p in enumerate(restart_plans)
            ]
        self.gate = gate
        clients: list[CoreClient] = [
            self.client(i, plan, after_requests) for i, plan in enumerate(plans)
        ]
        router = Router(len(plans), DPLoadBalanceConfig(policy="round_robin"), 4)
        self.dp = DPClient(clients, router, supervisors=supervisors)
        self.dp.max_model_len, self.dp.num_blocks = 128, 64
        self.counter = RestartCounter()
        setup = EngineSetup.from_engine_args(EngineArgs(max_model_len=128, log_stats=False))
        self.engine = AsyncLLM(setup, self.dp, tokenizer, stat_loggers=[self.counter])

    def starter(self, index: int, plans: Any) -> Any:
        async def start() -> AsyncInprocClient:
            if self.gate is not None:
                await self.gate.wait()
            plan = next(plans)
            if plan == "fail":
                raise RuntimeError("core failed to start")
            return self.client(index, plan)

        return start

    def client(
        self, index: int, steps_to_live: int | None, after_requests: int = 0
    ) -> AsyncInprocClient:
        runner, client = dying_core(self.token, steps_to_live, after_requests)
        self.runners[index].append(runner)
        return client

    def served(self, index: int, generation: int = 0) -> dict[str, list[int]]:
        """Request id -> the earlier output it brought, for each request a core was given."""
        return resumed_priors(self.runners[index][generation])

    def stream(self, request_id: str, max_tokens: int = 12) -> Awaitable[list[RequestOutput]]:
        return stream(self.engine, request_id, max_tokens)


async def test_a_dead_cores_streams_move_to_the_other_and_it_rejoins(tokenizer: Any) -> None:
    gate = asyncio.Event()
    # Core 1 dies 3 steps after it holds its three streams (round robin gives it
    # three of six), however slowly a busy machine tokenizes them.
    cluster = DPCluster(tokenizer, [None, 3], [[None], [None]], gate=gate, after_requests=3)
    engine, dp = cluster.engine, cluster.dp
    streams = {f"r{i}": cluster.stream(f"r{i}") for i in range(6)}
    await wait_for(lambda: engine.restarting)
    # Degraded, not dead; core 1 is out of routing and its streams already run on core 0.
    assert not engine.errored and engine.is_running
    await engine.check_health()
    moved = {rid for rid in cluster.served(1) if rid in streams}
    assert len(moved) == 3  # all of core 1's streams moved to core 0
    for request_id in moved:
        assert dp.router.owner(request_id) == 0
    aborted = "r1" if "r1" in moved else "r0"
    await engine.abort(aborted)  # an abort while the core restarts
    during = cluster.stream("during", max_tokens=3)
    assert dp.router.owner("during") in (0, None)  # not yet tokenized, or on core 0
    finished = await asyncio.wait_for(
        asyncio.gather(*(s for rid, s in streams.items() if rid != aborted), during), 10
    )
    assert len(cluster.runners[1]) == 1  # core 1 is still down while the gate is shut
    assert joined(await streams[aborted])[2] == "abort"
    for outputs in finished[:-1]:
        assert joined(outputs) == ("a" * 12, [cluster.token] * 12, "length")
    assert joined(finished[-1])[0] == "aaa"
    resumed = cluster.served(0)
    assert moved - {aborted} <= set(resumed)
    assert any(resumed.get(request_id) for request_id in moved), "nothing had output before"
    gate.set()
    await wait_for(lambda: not engine.restarting)
    assert dp.clients[1] is not None and len(cluster.runners[1]) == 2
    assert cluster.counter.restarts == 1
    assert cluster.counter.restarted_engines == [1]  # counted under the dead core's label
    # Core 1 is back in routing: new requests reach the new core.
    late = [cluster.stream(f"late{i}", max_tokens=2) for i in range(2)]
    for outputs in await asyncio.wait_for(asyncio.gather(*late), 10):
        assert joined(outputs)[0] == "aa"
    assert {"late0", "late1"} & set(cluster.served(1, generation=1))
    assert dp.router.loads == [0, 0]
    engine.shutdown()


async def test_without_restarts_the_survivor_serves_until_it_dies_too(tokenizer: Any) -> None:
    cluster = DPCluster(tokenizer, [20, 2], None)
    engine = cluster.engine
    first = [cluster.stream(f"r{i}", max_tokens=4) for i in range(2)]
    for outputs in await asyncio.wait_for(asyncio.gather(*first), 10):
        assert joined(outputs)[1] == [cluster.token] * 4
    assert engine.is_running and not engine.restarting
    more = [cluster.stream(f"n{i}", max_tokens=2) for i in range(2)]
    await asyncio.wait_for(asyncio.gather(*more), 10)
    assert {"n0", "n1"} <= set(cluster.served(0))  # core 1 is out of routing for good
    doomed = cluster.stream("doomed", max_tokens=50)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(doomed, 10)
    assert engine.errored
    engine.shutdown()


async def test_requests_wait_while_every_core_restarts(tokenizer: Any) -> None:
    gate = asyncio.Event()
    cluster = DPCluster(tokenizer, [2, 2], [[None], ["fail", None]], gate=gate)
    engine = cluster.engine
    streams = [cluster.stream(f"r{i}", max_tokens=8) for i in range(4)]
    await wait_for(lambda: all(not c.is_alive() for c in cluster.dp.clients))
    await wait_for(lambda: len(cluster.dp._held) == 4)
    assert engine.restarting and not engine.errored
    await engine.abort("r3")
    gate.set()
    results = await asyncio.wait_for(asyncio.gather(*streams), 10)
    for outputs in results[:3]:
        assert joined(outputs) == ("a" * 8, [cluster.token] * 8, "length")
    assert joined(results[3])[2] == "abort"
    assert cluster.counter.restarts == 3  # core 1's first start failed
    assert engine.is_running
    engine.shutdown()


async def test_dead_for_good_once_no_core_is_left_nor_can_restart(tokenizer: Any) -> None:
    cluster = DPCluster(tokenizer, [2, 2], [["fail", "fail"], ["fail", "fail"]])
    stream = cluster.stream("r", max_tokens=8)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(stream, 10)
    assert cluster.engine.errored and not cluster.engine.restarting
    with pytest.raises(EngineDeadError):
        await cluster.engine.check_health()
    assert cluster.counter.restarts == 4
    cluster.engine.shutdown()


class StateRecorder:
    """A stat logger that notes the engine's merged state after every step output."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self.running: list[int] = []
        # What each core's gauges (Prometheus: the ``engine`` label) read last.
        self.gauges: dict[int, int] = {}

    def record(self, stats: SchedulerStats | None, iteration: IterationStats | None) -> None:
        state = self.engine.latest_scheduler_stats
        if state is not None:
            self.running.append(state.num_running_reqs)
        if stats is not None and iteration is not None:
            self.gauges[iteration.engine_index] = stats.num_running_reqs


@pytest.mark.parametrize("plans", [[None, None], [None, 3]], ids=["both-live", "core-1-dies"])
async def test_the_engine_state_sums_its_live_cores(
    tokenizer: Any, plans: list[int | None]
) -> None:
    """Six streams, three per core: the engine runs six, not the last reporting core's
    three; a dead core's last snapshot no longer counts once its streams moved."""
    cluster = DPCluster(tokenizer, plans, None)
    engine = cluster.engine
    recorder = StateRecorder(engine)
    engine.stat_loggers.append(recorder)
    streams = [cluster.stream(f"r{i}", max_tokens=40) for i in range(6)]
    await asyncio.wait_for(asyncio.gather(*streams), 10)
    assert max(recorder.running) == 6
    state = engine.latest_scheduler_stats
    assert state is not None and (state.num_running_reqs, state.num_waiting_reqs) == (0, 0)
    assert engine.num_running_requests == 0 and state.kv_cache_usage == 0.0
    assert recorder.gauges == {0: 0, 1: 0}  # a dead core's gauges do not keep its last load
    engine.shutdown()


def test_engine_state_sums_queues_and_averages_kv_usage() -> None:
    assert engine_state([]) is None
    state = engine_state(
        [
            SchedulerStats(3, 1, 0.5, prefix_cache_queries=64, prefix_cache_hits=32),
            SchedulerStats(2, 0, 0.25, num_preemptions=1),
        ]
    )
    assert state == SchedulerStats(num_running_reqs=5, num_waiting_reqs=1, kv_cache_usage=0.375)
