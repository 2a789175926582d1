"""The running summary of speculative decoding's acceptance, under vLLM's names.

The scheduler fills one ``SpecDecodingStats`` (``tokenloom.outputs``) per step
and sends it inside ``SchedulerStats``; the periodic log line, the Prometheus
counters and the benchmarks add them up here. Pure Python.
"""

from __future__ import annotations

from tokenloom.outputs import SpecDecodingStats


class SpecDecodingSummary:
    """Running totals of many steps' stats, with the two figures people read:
    acceptance rate (accepted / drafted tokens) and mean acceptance length
    (tokens a verifying request gains per step: 1 + accepted / drafts)."""

    def __init__(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []

    def add(self, stats: SpecDecodingStats | None) -> None:
        if stats is None:
            return
        self.num_drafts += stats.num_drafts
        self.num_draft_tokens += stats.num_draft_tokens
        self.num_accepted_tokens += stats.num_accepted_tokens
        per_pos = stats.num_accepted_tokens_per_pos
        if len(self.accepted_per_pos) < len(per_pos):
            self.accepted_per_pos.extend([0] * (len(per_pos) - len(self.accepted_per_pos)))
        for i, count in enumerate(per_pos):
            self.accepted_per_pos[i] += count

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def per_position_rates(self) -> list[float]:
        """Share of verifying requests whose draft at each position was accepted."""
        if not self.num_drafts:
            return []
        return [count / self.num_drafts for count in self.accepted_per_pos]

    def describe(self) -> str:
        """One log fragment, e.g. ``acceptance rate 41.2%, mean acceptance length 2.30``."""
        rates = ", ".join(f"{rate:.2f}" for rate in self.per_position_rates())
        return (
            f"spec decode: acceptance rate {self.acceptance_rate * 100:.1f}%, "
            f"mean acceptance length {self.mean_acceptance_length:.2f}, "
            f"{self.num_drafts} drafts, {self.num_draft_tokens} draft tokens, "
            f"per-position acceptance [{rates}]"
        )

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]
