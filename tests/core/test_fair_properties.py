"""Property tests of the fair policy: shares converge to the weights, nobody starves.

Tenants keep a backlog of random requests; the Harness checks every step
(budget, seats, the runner's view, the tenants' books) and each run ends
with the leak check. The same workloads under FCFS or priority show what the
fair policy prevents.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.core.utils import Harness, assert_no_leaks, make_request, make_scheduler
from tokenloom.core.sched.scheduler import Scheduler

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def configs(draw: st.DrawFn) -> dict:
    return {
        "max_num_seqs": draw(st.integers(2, 12)),
        "max_num_batched_tokens": draw(st.integers(8, 64)),
        "block_size": 4,
        # From barely enough for a few requests (preemption) to plenty.
        "num_blocks": draw(st.sampled_from([12, 24, 1000])),
        "fair_burst_tokens": draw(st.sampled_from([0, 64, 8192])),
        "enable_prefix_caching": draw(st.booleans()),
        "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 8])),
    }


class Tenants:
    """Drives a scheduler with tenants that each keep ``backlog`` requests waiting."""

    def __init__(
        self,
        scheduler: Scheduler,
        weights: list[float],
        seed: int,
        priorities: list[int] | None = None,
    ) -> None:
        self.h = Harness(scheduler)
        self.weights = weights
        self.priorities = priorities or [0] * len(weights)
        self.rng = random.Random(seed)
        self.tenant_of: dict[str, int] = {}
        self.added_at: dict[str, int] = {}
        self.step_no = 0
        self.tokens = [0] * len(weights)

    def add(self, tenant: int) -> str:
        req_id = f"r{len(self.tenant_of)}"
        self.tenant_of[req_id] = tenant
        self.added_at[req_id] = self.step_no
        self.h.add(
            make_request(
                req_id,
                self.rng.randint(2, 16),
                max_tokens=self.rng.randint(1, 12),
                tenant=f"t{tenant}",
                tenant_weight=self.weights[tenant],
                priority=self.priorities[tenant],
                arrival_time=float(self.step_no),
            )
        )
        return req_id

    def top_up(self, tenants: list[int], backlog: int) -> None:
        waiting = [0] * len(self.weights)
        for request in self.h.scheduler.waiting:
            waiting[self.tenant_of[request.request_id]] += 1
        for tenant in tenants:
            for _ in range(backlog - waiting[tenant]):
                self.add(tenant)

    def step(self, count: bool) -> set[str]:
        so = self.h.step()
        self.step_no += 1
        if count:
            for req_id, num in so.num_scheduled_tokens.items():
                self.tokens[self.tenant_of[req_id]] += num
        return set(so.num_scheduled_tokens)

    def finish(self) -> None:
        self.h.run_until_done()
        assert_no_leaks(self.h.scheduler)


@SETTINGS
@given(
    config=configs(),
    weights=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=2, max_size=3),
    seed=st.integers(0, 2**16),
)
# Blocks for barely two requests: a request that preempts itself must not stop
# the ones after it from running (else two resumed requests evict each other forever).
@example(
    config={
        "max_num_seqs": 2,
        "max_num_batched_tokens": 34,
        "block_size": 4,
        "num_blocks": 12,
        "fair_burst_tokens": 0,
        "enable_prefix_caching": False,
        "long_prefill_token_threshold": 0,
    },
    weights=[0.5, 0.5],
    seed=0,
)
def test_shares_converge_to_the_weights(config: dict, weights: list[float], seed: int) -> None:
    """Every tenant always has requests waiting: after a warm-up, each one's share of
    the scheduled tokens is its weight's share, within 4 points."""
    run = Tenants(make_scheduler(policy="fair", **config), weights, seed)
    everyone = list(range(len(weights)))
    for step in range(600):
        run.top_up(everyone, backlog=2)
        run.step(count=step >= 200)
    total = sum(run.tokens)
    shares = [tokens / total for tokens in run.tokens]
    wanted = [weight / sum(weights) for weight in weights]
    assert max(abs(s - w) for s, w in zip(shares, wanted, strict=True)) < 0.04, (shares, wanted)
    run.finish()


def test_fcfs_does_not_share_by_weight() -> None:
    """The convergence check above fails without the fair policy."""
    run = Tenants(make_scheduler(policy="fcfs", max_num_seqs=8), [1.0, 3.0], seed=0)
    for step in range(600):
        run.top_up([0, 1], backlog=2)
        run.step(count=step >= 200)
    assert run.tokens[1] / sum(run.tokens) < 0.6
    run.finish()


def _light_waits(run: Tenants, light_at: list[int], steps: int) -> list[int]:
    """Tenant 0 floods every step; tenant 1 sends one request at each step in
    ``light_at``. The steps each light request waited until it finished (or until
    ``steps`` ran out)."""
    sent: dict[str, int] = {}
    done: dict[str, int] = {}
    for step in range(steps):
        run.top_up([0], backlog=4)
        if step in light_at:
            sent[run.add(1)] = step
        run.step(count=False)
        for req_id in sent:
            if req_id not in done and req_id not in run.h.scheduler.requests:
                done[req_id] = run.step_no
    return [done.get(req_id, steps) - at for req_id, at in sent.items()]


@SETTINGS
@given(
    config=configs(),
    heavy_weight=st.sampled_from([1.0, 4.0, 10.0]),
    light_at=st.lists(st.integers(0, 200), min_size=1, max_size=4, unique=True),
    seed=st.integers(0, 2**16),
)
def test_a_light_tenant_is_never_starved_by_a_flood(
    config: dict, heavy_weight: float, light_at: list[int], seed: int
) -> None:
    """While the heavy tenant floods, each of the light tenant's requests finishes
    within the time its weight's share of the engine takes to serve all of the
    light tenant's requests (at most 28 tokens each), twice over, plus a start-up."""
    run = Tenants(make_scheduler(policy="fair", **config), [heavy_weight, 1.0], seed)
    tokens_per_step = min(config["max_num_batched_tokens"], config["max_num_seqs"])
    bound = 100 + 2 * len(light_at) * 28 * (heavy_weight + 1.0) / tokens_per_step
    waits = _light_waits(run, light_at, steps=max(light_at) + int(bound) + 1)
    assert max(waits) <= bound, (waits, bound)
    run.finish()


def test_a_light_request_is_not_preempted_forever() -> None:
    """Tight blocks and no prefix cache: each preemption throws the light request's
    work away. Were the victim the request of the tenant furthest ahead, the light
    request, ahead again as soon as it has recomputed, would give way every time
    and never finish; as the latest start in virtual time it is protected."""
    config = {
        "max_num_seqs": 12,
        "max_num_batched_tokens": 13,
        "block_size": 4,
        "num_blocks": 12,
        "enable_prefix_caching": False,
        "fair_burst_tokens": 0,
    }
    run = Tenants(make_scheduler(policy="fair", **config), [10.0, 1.0], seed=0)
    waits = _light_waits(run, [11, 145, 188, 249], steps=1000)
    assert max(waits) < 100, waits
    run.finish()


def test_priority_without_aging_starves_the_same_light_tenant() -> None:
    """The starvation the fair policy (and priority aging) prevents."""
    waits = {}
    for aging_s in (0.0, 4.0):
        scheduler = make_scheduler(policy="priority", max_num_seqs=4, priority_aging_s=aging_s)
        # The flood (tenant 0) outranks the light tenant.
        run = Tenants(scheduler, [1.0, 1.0], seed=0, priorities=[0, 5])
        waits[aging_s] = _light_waits(run, [10], steps=400)
        run.finish()
    assert waits[0.0] == [390]  # never finished while the flood lasted
    assert waits[4.0][0] < 100
