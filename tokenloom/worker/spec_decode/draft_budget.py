"""How many drafts each request may get next step: speculation only where it pays.

Three rules, all evaluated by the runner right before proposing:

* **Batch size**: no request drafts in a step whose batch holds more than
  ``disable_by_batch_size`` requests. A large batch already keeps the
  hardware busy, so verifying drafts costs nearly what it saves.
* **Per-request acceptance**: each request keeps decayed counts of its
  accepted drafts and of its rejections (a verification ends either with all
  drafts accepted or with one rejection), which estimate the chance ``a`` that
  its next draft is accepted (the first-rejection model: the draft at
  position ``i`` is kept with probability ``a ** i``). A request drafts up to
  the last position still kept with probability ``>= MIN_KEEP_PROBABILITY``,
  so a request whose drafts are rarely accepted drafts fewer tokens, down to
  none. A request that got no drafts for ``PROBE_INTERVAL`` of its steps
  (by this rule or the next) is probed (at least one draft, judged by the
  next rule as if kept), so text that turns repetitive later is noticed.
* **Step cost**: with the fitted step cost (``step_cost.StepCostModel``:
  ``fixed + per_token * tokens``), drafts go only where they raise the
  expected tokens per second of the next step. The ``j``-th draft of a request
  with acceptance ``a`` yields ``a ** j`` tokens and costs ``per_token``
  seconds (charged ``DRAFT_COST_MARGIN`` times that); drafts are taken in order of yield while the rate
  ``(requests + kept drafts) / decode step seconds`` still rises
  (``cost_limited``).
  At one request the fixed cost dominates and every draft pays; in a
  compute-bound batch only drafts that are nearly sure to be kept do, or none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tokenloom.worker.spec_decode.step_cost import StepCost, StepCostModel

# Drafts at positions kept with a smaller probability cost more than they save.
MIN_KEEP_PROBABILITY = 0.25
# Weight of the past at each verification (about the last 1 / (1 - DECAY) count).
DECAY = 0.8
# A fresh request starts as if one verification had accepted PRIOR_ACCEPT of a draft.
PRIOR_ACCEPT = 0.8
# Steps a request with no budget waits before one probing draft.
PROBE_INTERVAL = 8
# Drafts are charged this much above the fitted per-token cost: what the fit does
# not see (scheduler bookkeeping of drafts, rollback of rejected slots, noise in the
# fit itself), so speculation in a borderline batch errs towards not drafting.
DRAFT_COST_MARGIN = 1.25


@dataclass
class _Acceptance:
    accepted: float = PRIOR_ACCEPT
    rejected: float = 1.0 - PRIOR_ACCEPT
    budget: int = -1  # -1: not computed yet
    idle_steps: int = 0


class DraftBudget:
    """Per-request draft caps; state is keyed by request id and dropped by ``forget``."""

    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: int | None) -> None:
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self._states: dict[str, _Acceptance] = {}
        self._full = self._budget(PRIOR_ACCEPT)
        self.step_cost = StepCostModel()

    def enabled(self, batch_size: int) -> bool:
        """Whether a step with ``batch_size`` requests speculates at all."""
        limit = self.disable_by_batch_size
        return limit is None or batch_size <= limit

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A measured forward step of ``num_tokens`` scheduled tokens."""
        self.step_cost.observe(num_tokens, seconds)

    def caps(self, req_ids: list[str], room: np.ndarray | None = None) -> np.ndarray:
        """Most drafts each of the decoding requests ``req_ids`` may get next
        (counting a probe as one step).

        ``room``: drafts each request could still keep (its ``max_tokens`` and the
        context). With a fitted step cost, drafts are cut to those that pay.
        """
        states = [self._state(req_id) for req_id in req_ids]
        accept = np.fromiter((s.accepted / (s.accepted + s.rejected) for s in states), float)
        caps = np.fromiter((max(s.budget, 0) for s in states), np.int64, len(states))
        probe = np.fromiter((s.idle_steps + 1 >= PROBE_INTERVAL for s in states), bool)
        caps = np.where(probe, np.maximum(caps, 1), caps)
        if room is not None:
            caps = np.minimum(caps, room)
        cost = self.step_cost.estimate
        if cost is not None and caps.any():
            # A request due a probe is judged as if its drafts were all kept
            # (optimism under uncertainty): one whose estimate does not pay at this
            # batch size is still tried now and then, and gets drafts back when
            # they turn out to be kept.
            caps = cost_limited(caps, np.where(probe, 1.0, accept), cost)
        for state, cap in zip(states, caps.tolist(), strict=True):
            if cap == 0:
                state.idle_steps += 1
        return caps

    def _state(self, req_id: str) -> _Acceptance:
        state = self._states.get(req_id)
        if state is None:
            state = self._states[req_id] = _Acceptance(budget=self._full)
        return state

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """Fold one verification (``num_drafts`` proposed, ``num_accepted`` kept) in."""
        if num_drafts <= 0:
            return
        state = self._states.get(req_id)
        if state is None:
            state = self._states[req_id] = _Acceptance()
        state.accepted = DECAY * state.accepted + num_accepted
        state.rejected = DECAY * state.rejected + (1.0 if num_accepted < num_drafts else 0.0)
        state.budget = self._budget(state.accepted / (state.accepted + state.rejected))
        state.idle_steps = 0

    def acceptance(self, req_id: str) -> float | None:
        """The current estimate for a request (None: never seen)."""
        state = self._states.get(req_id)
        return None if state is None else state.accepted / (state.accepted + state.rejected)

    def forget(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._states)

    def _budget(self, accept: float) -> int:
        """Largest i <= k with accept ** i >= MIN_KEEP_PROBABILITY (0 if none)."""
        if accept >= 1.0:
            return self.k
        if accept <= 0.0:
            return 0
        return min(self.k, int(math.log(MIN_KEEP_PROBABILITY) / math.log(accept) + 1e-9))


def cost_limited(
    caps: np.ndarray, accept: np.ndarray, cost: StepCost, margin: float = DRAFT_COST_MARGIN
) -> np.ndarray:
    """Drafts per decoding request (each at most ``caps[i]``) that maximise the
    expected tokens per second of a decode step over these requests, each draft
    charged ``margin`` times the per-token cost.

    Without drafts the step computes and yields one token per request. Prefill
    chunks sharing the step are left out of the rate: they are work the batch
    needs anyway, not an alternative use of the drafts' time.

    Draft ``j`` (1-based) of request ``i`` yields ``accept[i] ** j``, which falls
    with ``j``, so taking candidates in order of yield gives each request a prefix
    of its drafts; since yields fall, the rate over that order rises to one peak.
    """
    num, k = len(caps), int(caps.max())
    position = np.arange(1, k + 1)
    gains = np.power(accept[:, None], position[None, :])
    allowed = (position[None, :] <= caps[:, None]).ravel()
    candidates = np.flatnonzero(allowed)
    flat = gains.ravel()[candidates]
    order = np.argsort(-flat, kind="stable")
    tokens = num + np.concatenate(([0.0], np.cumsum(flat[order])))
    drafts = np.arange(len(order) + 1)
    seconds = cost.fixed + cost.per_token * (num + margin * drafts)
    taken = int(np.argmax(tokens / seconds))
    rows = candidates[order[:taken]] // k
    return np.bincount(rows, minlength=num).astype(np.int64)
