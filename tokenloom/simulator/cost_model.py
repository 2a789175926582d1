"""How long a step takes, from what it holds: a linear model fitted to recorded steps.

A step's time is modelled as ``a + b*tokens + c*requests + d*sampled +
e*attention``: a fixed cost (launching the forward pass, reading every weight
once, the core loop around it), a cost per token (the matmuls), per request
(bookkeeping, block tables), per sampled row (the LM head and the sampler)
and per query-key pair attended (``attention``, in thousands). The
coefficients are fitted by least squares with every coefficient kept
non-negative, so that a configuration beyond the recorded ones never gets
steps that cost less for holding more.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenloom.core.sched.output import SchedulerOutput

FEATURES = ("const", "tokens", "requests", "sampled", "attention")


@dataclass(frozen=True)
class StepShape:
    """What one step ran, as the cost model sees it."""

    tokens: int  # scheduled tokens
    requests: int  # scheduled requests
    sampled: int  # requests that sample (not a partial prefill)
    attention: float  # query-key pairs attended, in thousands

    def vector(self) -> list[float]:
        return [1.0, self.tokens, self.requests, self.sampled, self.attention]


def step_shape(scheduler_output: SchedulerOutput, sampled: int) -> StepShape:
    """The shape of a step; ``sampled``: how many of its requests sample.

    A request with ``c`` tokens already computed that gets ``n`` more attends
    ``n * c + n * (n + 1) / 2`` query-key pairs (causal within its chunk).
    """
    num_scheduled = scheduler_output.num_scheduled_tokens
    pairs = 0.0
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
        n = num_scheduled[req_id]
        pairs += n * computed + n * (n + 1) / 2
    for new in scheduler_output.scheduled_new_reqs:
        n = num_scheduled[new.req_id]
        pairs += n * new.num_computed_tokens + n * (n + 1) / 2
    return StepShape(
        tokens=scheduler_output.total_num_scheduled_tokens,
        requests=len(num_scheduled),
        sampled=sampled,
        attention=pairs / 1000.0,
    )


@dataclass(frozen=True)
class CostModel:
    """Seconds per step = ``coefficients . shape.vector()``; ``step_gap_s``: the core
    loop's time between two steps (sending outputs, reading input), measured."""

    coefficients: tuple[float, ...]
    step_gap_s: float
    # How well it fits the steps it was fitted to (mean absolute error over mean).
    relative_error: float
    num_steps: int

    def step_seconds(self, shape: StepShape) -> float:
        """A step's duration (schedule, forward pass, update), without the gap."""
        return float(np.dot(self.coefficients, shape.vector()))

    def describe(self) -> str:
        terms = ", ".join(
            f"{name} {coef * 1e3:.4g} ms"
            for name, coef in zip(FEATURES, self.coefficients, strict=True)
            if coef > 0
        )
        return (
            f"step = {terms} (+ {self.step_gap_s * 1e3:.2f} ms between steps); "
            f"fitted to {self.num_steps} steps, mean error {self.relative_error:.1%}"
        )

    @classmethod
    def fit(
        cls, shapes: Sequence[StepShape], durations: Sequence[float], step_gap_s: float = 0.0
    ) -> CostModel:
        """Non-negative least squares over ``FEATURES``. With so few features every
        subset is tried, and the best fit whose coefficients are all >= 0 wins
        (this is exact NNLS, without a solver)."""
        if len(shapes) != len(durations):
            raise ValueError(
                f"shapes and durations differ in length: {len(shapes)} != {len(durations)}"
            )
        if not shapes:
            raise ValueError("the trace has no steps to fit a cost model to")
        x = np.array([s.vector() for s in shapes], dtype=np.float64)
        y = np.asarray(durations, dtype=np.float64)
        # Scale the columns so that lstsq's conditioning does not depend on units.
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        xs = x / scale
        best: np.ndarray | None = None
        best_residual = np.inf
        columns = range(x.shape[1])
        for size in range(1, x.shape[1] + 1):
            for subset in itertools.combinations(columns, size):
                cols = list(subset)
                coef, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
                if np.any(coef < 0):
                    continue
                residual = float(np.sum((xs[:, cols] @ coef - y) ** 2))
                if residual < best_residual - 1e-18:
                    best_residual = residual
                    best = np.zeros(x.shape[1])
                    best[cols] = coef
        assert best is not None  # a single column always fits with a coefficient >= 0
        coefficients = best / scale
        predicted = x @ coefficients
        mean = float(np.mean(y)) or 1.0
        error = float(np.mean(np.abs(predicted - y))) / mean
        return cls(tuple(float(c) for c in coefficients), step_gap_s, error, len(shapes))
