"""What a forward step costs, as a function of the tokens it computes: fitted online.

A step's time is modelled as ``fixed + per_token * scheduled tokens``: the
fixed part is what every step pays whatever its size (reading the weights,
launching kernels, sampling), the per-token part the compute each token adds.
At one request the fixed part dominates, so a draft costs little; in a large
batch the step is compute-bound and every draft costs nearly a full token.

The runner reports the scheduled tokens and measured seconds of its decode
steps (every token a logits row, as a draft is; prefill tokens, without logits
and sampling, cost less and would pull the slope down); the fit is
exponentially weighted least squares (recent steps count most, so a machine
whose load changes is followed), kept as five running sums.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of the past per observed step (about the last 1 / (1 - DECAY) steps count).
DECAY = 0.98
# Token counts must spread at least this much (standard deviation) to fit a slope.
MIN_TOKEN_SPREAD = 0.5


@dataclass(frozen=True)
class StepCost:
    """Seconds of a step: ``fixed + per_token * tokens``."""

    fixed: float
    per_token: float

    def seconds(self, tokens: float) -> float:
        return self.fixed + self.per_token * tokens


class StepCostModel:
    """Online fit of ``StepCost`` from ``observe(tokens, seconds)``.

    ``estimate`` is None until the observed token counts spread enough to tell
    the fixed from the per-token cost; afterwards, while they do not (a steady
    batch), the last fit is kept.
    """

    def __init__(self, decay: float = DECAY) -> None:
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._estimate: StepCost | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        x = float(tokens)
        self._w = d * self._w + 1.0
        self._x = d * self._x + x
        self._y = d * self._y + seconds
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * seconds
        self._refit()

    def _refit(self) -> None:
        w = self._w
        mean_x, mean_y = self._x / w, self._y / w
        var_x = self._xx / w - mean_x * mean_x
        if var_x < MIN_TOKEN_SPREAD**2:
            return
        slope = max((self._xy / w - mean_x * mean_y) / var_x, 0.0)
        # Noise may put the intercept below zero; a step's fixed cost is not negative.
        fixed = max(mean_y - slope * mean_x, 1e-9)
        self._estimate = StepCost(fixed, slope)

    @property
    def estimate(self) -> StepCost | None:
        return self._estimate
