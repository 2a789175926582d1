"""How many drafts each request may get next step: speculation only where it pays.

Two rules, both evaluated by the runner right before proposing:

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
  none. A request at none is probed with one draft every ``PROBE_INTERVAL``
  of its steps, so text that turns repetitive later is noticed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Drafts at positions kept with a smaller probability cost more than they save.
MIN_KEEP_PROBABILITY = 0.25
# Weight of the past at each verification (about the last 1 / (1 - DECAY) count).
DECAY = 0.8
# A fresh request starts as if one verification had accepted PRIOR_ACCEPT of a draft.
PRIOR_ACCEPT = 0.8
# Steps a request with no budget waits before one probing draft.
PROBE_INTERVAL = 8


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

    def enabled(self, batch_size: int) -> bool:
        """Whether a step with ``batch_size`` requests speculates at all."""
        limit = self.disable_by_batch_size
        return limit is None or batch_size <= limit

    def caps(self, req_ids: list[str]) -> list[int]:
        """Most drafts each request may get next (counting a probe as one step)."""
        states = self._states
        result = []
        for req_id in req_ids:
            state = states.get(req_id)
            if state is None:
                state = states[req_id] = _Acceptance(budget=self._full)
            if state.budget > 0:
                result.append(state.budget)
            else:
                state.idle_steps += 1
                result.append(1 if state.idle_steps >= PROBE_INTERVAL else 0)
        return result

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
