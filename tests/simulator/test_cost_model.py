"""The step-cost model: shapes read off a SchedulerOutput, non-negative least squares."""

from __future__ import annotations

import random

import pytest

from tests.core.utils import Harness, make_request, make_scheduler
from tokenloom.simulator.cost_model import CostModel, StepShape, step_shape


def test_fit_recovers_the_costs_that_made_the_durations() -> None:
    rng = random.Random(0)
    truth = (0.004, 2e-5, 1e-4, 3e-4, 5e-6)
    shapes = [
        StepShape(
            tokens=rng.randrange(1, 512),
            requests=rng.randrange(1, 32),
            sampled=rng.randrange(0, 32),
            attention=rng.uniform(0, 300),
        )
        for _ in range(200)
    ]
    durations = [sum(c * x for c, x in zip(truth, s.vector(), strict=True)) for s in shapes]
    model = CostModel.fit(shapes, durations, step_gap_s=0.001)
    assert model.coefficients == pytest.approx(truth, rel=1e-6)
    assert model.relative_error < 1e-9 and model.step_gap_s == 0.001
    assert model.step_seconds(StepShape(100, 4, 4, 10.0)) == pytest.approx(
        sum(c * x for c, x in zip(truth, (1, 100, 4, 4, 10.0), strict=True))
    )


def test_no_coefficient_goes_negative() -> None:
    # More requests per token made steps *faster* in this data; the fit must not
    # learn that, or a larger batch would be predicted to cost less.
    shapes = [
        StepShape(tokens=t, requests=r, sampled=r, attention=0.0)
        for t, r in ((100, 1), (100, 20), (200, 1), (200, 20))
    ]
    durations = [0.030, 0.020, 0.050, 0.040]
    model = CostModel.fit(shapes, durations)
    assert min(model.coefficients) >= 0
    assert model.step_seconds(StepShape(300, 30, 30, 0.0)) >= model.step_seconds(
        StepShape(300, 1, 1, 0.0)
    )
    assert "fitted to 4 steps" in model.describe()


def test_fit_refuses_what_it_cannot_use() -> None:
    with pytest.raises(ValueError, match="no steps"):
        CostModel.fit([], [])
    with pytest.raises(ValueError, match="differ in length"):
        CostModel.fit([StepShape(1, 1, 1, 0.0)], [])


def test_step_shape_counts_tokens_requests_and_attention() -> None:
    h = Harness(make_scheduler(max_num_batched_tokens=10, block_size=4))
    h.add(make_request("a", 6, max_tokens=3), make_request("b", 9, max_tokens=3))
    first = h.schedule()  # a: 6 new tokens from 0; b: 4 from 0
    shape = step_shape(first, sampled=1)
    assert (shape.tokens, shape.requests, shape.sampled) == (10, 2, 1)
    assert shape.attention == pytest.approx((6 * 7 / 2 + 4 * 5 / 2) / 1000)
    h.run(first)
    second = h.schedule()  # a: 1 token after 6; b: 5 after 4
    assert step_shape(second, sampled=2).attention == pytest.approx(
        (1 * 6 + 1 + 5 * 4 + 5 * 6 / 2) / 1000
    )
