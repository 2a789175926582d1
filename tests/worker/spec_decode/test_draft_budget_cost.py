"""The batch-aware part of the draft budget: the step-cost fit and the drafts it pays for.

Costs are synthetic (seconds = fixed + per_token * tokens) so the tests know the
right answer; a budget that ignored the cost would draft fully in every case.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tokenloom.worker.spec_decode.draft_budget import (
    DRAFT_COST_MARGIN,
    PROBE_INTERVAL,
    DraftBudget,
    cost_limited,
)
from tokenloom.worker.spec_decode.step_cost import StepCost, StepCostModel

# About the default model on this CPU: ~50 ms a step plus ~5 ms a token.
CPU_LIKE = StepCost(fixed=0.050, per_token=0.005)


def test_fit_recovers_fixed_and_per_token_cost() -> None:
    model = StepCostModel()
    model.observe(8, 0.09)
    assert model.estimate is None  # one token count cannot separate the two parts
    rng = np.random.default_rng(0)
    for tokens in rng.integers(1, 200, size=100).tolist():
        model.observe(tokens, CPU_LIKE.seconds(tokens))
    est = model.estimate
    assert est is not None
    assert est.fixed == pytest.approx(CPU_LIKE.fixed, rel=1e-6)
    assert est.per_token == pytest.approx(CPU_LIKE.per_token, rel=1e-6)


def test_fit_keeps_its_estimate_in_a_steady_batch_and_follows_a_change() -> None:
    model = StepCostModel()
    for tokens in [1, 64, 5, 100, 20] * 4:
        model.observe(tokens, CPU_LIKE.seconds(tokens))
    for _ in range(500):  # the same batch for a long time: no spread left to fit
        model.observe(64, CPU_LIKE.seconds(64))
    est = model.estimate
    assert est is not None
    assert est.fixed == pytest.approx(CPU_LIKE.fixed, rel=1e-6)
    assert est.per_token == pytest.approx(CPU_LIKE.per_token, rel=1e-6)
    frozen = est
    model.observe(64, 1.0)  # one slow step of the same size cannot be fitted: kept
    assert model.estimate == frozen
    slower = StepCost(fixed=0.1, per_token=0.02)  # e.g. the machine got busy
    for tokens in [1, 64, 5, 100, 20] * 60:
        model.observe(tokens, slower.seconds(tokens))
    est = model.estimate
    assert est is not None
    assert est.per_token == pytest.approx(slower.per_token, rel=0.05)
    assert est.fixed == pytest.approx(slower.fixed, rel=0.05)


def test_one_request_drafts_fully_a_compute_bound_batch_does_not() -> None:
    caps = np.array([4])
    assert cost_limited(caps, np.array([0.8]), CPU_LIKE).tolist() == [4]
    # 64 requests: a step costs 370 ms for 64 tokens (0.173 tokens/ms); a first draft
    # kept with probability 0.8 yields 0.8 tokens for 5 ms (0.16 tokens/ms): not worth it.
    caps = np.full(64, 4)
    assert cost_limited(caps, np.full(64, 0.8), CPU_LIKE).sum() == 0
    # Nearly sure drafts still pay there (at their fitted cost), the first ones most;
    # charged the safety margin, they do not.
    drafts = cost_limited(caps, np.full(64, 0.97), CPU_LIKE, margin=1.0)
    assert drafts.min() >= 1 and drafts.max() < 4
    assert cost_limited(caps, np.full(64, 0.97), CPU_LIKE).sum() == 0


def test_drafts_go_to_the_requests_most_likely_to_keep_them() -> None:
    accept = np.array([0.3, 0.99, 0.6, 0.95] * 8)
    drafts = cost_limited(np.full(32, 4), accept, CPU_LIKE, margin=1.0)
    by_accept = {a: set(drafts[accept == a].tolist()) for a in accept.tolist()}
    assert by_accept[0.3] == {0} and by_accept[0.6] == {0}
    assert min(by_accept[0.99]) >= min(by_accept[0.95]) >= 1


def test_caps_limit_the_choice() -> None:
    drafts = cost_limited(np.array([2, 0, 3]), np.full(3, 0.9), CPU_LIKE)
    assert drafts.tolist() == [2, 0, 3]


def _rate(drafts: tuple[int, ...], accept: np.ndarray, cost: StepCost, margin: float) -> float:
    """Expected tokens per second of a decode step, by the definition (drafts charged
    ``margin`` times the per-token cost)."""
    kept = sum(float(a) ** j for a, d in zip(accept, drafts, strict=True) for j in range(1, d + 1))
    return (len(accept) + kept) / cost.seconds(len(accept) + margin * sum(drafts))


@pytest.mark.parametrize("margin", [1.0, DRAFT_COST_MARGIN])
@pytest.mark.parametrize("seed", range(20))
def test_allotment_is_the_best_rate_among_all_allotments(seed: int, margin: float) -> None:
    rng = np.random.default_rng(seed)
    num, k = 4, 3
    accept = rng.uniform(0.05, 1.0, num)
    caps = rng.integers(0, k + 1, num)
    cost = StepCost(fixed=float(rng.uniform(0.001, 0.1)), per_token=float(rng.uniform(0.001, 0.02)))
    best = max(
        _rate(d, accept, cost, margin)
        for d in itertools.product(*(range(int(c) + 1) for c in caps))
    )
    if not caps.any():
        return
    chosen = cost_limited(caps, accept, cost, margin)
    assert (chosen <= caps).all()
    assert _rate(tuple(chosen.tolist()), accept, cost, margin) == pytest.approx(best, rel=1e-9)


def _budget_with_cost(cost: StepCost) -> DraftBudget:
    budget = DraftBudget(4, None)
    for tokens in [1, 8, 3, 64, 30, 2, 90, 16]:
        budget.observe_step(tokens, cost.seconds(tokens))
    return budget


def test_budget_follows_the_measured_step_cost() -> None:
    ids = [f"r{i}" for i in range(64)]
    # Without a fitted cost (nothing measured yet) the acceptance alone decides.
    assert DraftBudget(4, None).caps(ids).tolist() == [4] * 64
    # A machine where a token is cheap next to the fixed cost: drafts pay.
    cheap = _budget_with_cost(StepCost(fixed=0.5, per_token=0.001))
    assert cheap.caps(ids).tolist() == [4] * 64
    # A compute-bound machine: 64 requests at acceptance 0.8 draft nothing ...
    bound = _budget_with_cost(CPU_LIKE)
    assert bound.caps(ids).tolist() == [0] * 64
    # ... while one request alone on it still drafts fully.
    assert bound.caps(["alone"]).tolist() == [4]
    # The room left to each request bounds it first.
    assert bound.caps(["alone"], room=np.array([2])).tolist() == [2]


def test_requests_the_cost_rule_turns_down_are_probed_optimistically() -> None:
    # 8 requests: a step yields 8 tokens in 55 ms (145 tokens/s); a draft charged
    # 1.25 * 5 ms pays at acceptance 1 (160/s), not at the prior 0.8 (128/s).
    budget = _budget_with_cost(StepCost(fixed=0.015, per_token=0.005))
    ids = [f"r{i}" for i in range(8)]
    assert [budget.caps(ids).sum() for _ in range(PROBE_INTERVAL - 1)] == [0] * 7
    probed = budget.caps(ids)
    assert (probed >= 1).all()
    for req_id, cap in zip(ids, probed.tolist(), strict=True):
        budget.observe(req_id, cap, cap)  # all kept
    assert (budget.caps(ids) >= 1).all()  # acceptance now pays by itself
    # On a compute-bound batch even a sure draft does not pay: no probe either.
    bound = _budget_with_cost(CPU_LIKE)
    many = [f"m{i}" for i in range(64)]
    assert sum(bound.caps(many).sum() for _ in range(3 * PROBE_INTERVAL)) == 0
