"""The scheduler's abstract API (the seeds' ``SchedulerInterface``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.outputs import EngineCoreOutputs, ModelRunnerOutput, SchedulerStats
from tokenloom.request import Request, RequestStatus


class SchedulerInterface(ABC):
    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new request."""

    @abstractmethod
    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """End requests (client abort, or a stop string found by the frontend).

        Unknown or already finished ids are ignored.
        """

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Decide the next forward pass: ``{request_id: num_tokens}`` plus deltas."""

    @abstractmethod
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Apply sampled tokens, detect finished requests, return outputs per client."""

    @abstractmethod
    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Record draft tokens proposed for the next step."""

    @abstractmethod
    def get_request_counts(self) -> tuple[int, int]:
        """``(num_running, num_waiting)``."""

    def get_num_unfinished_requests(self) -> int:
        return sum(self.get_request_counts())

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    @abstractmethod
    def has_finished_requests(self) -> bool:
        """True when finished ids wait to be sent in the next ``SchedulerOutput``."""

    def has_requests(self) -> bool:
        return self.has_unfinished_requests() or self.has_finished_requests()

    @abstractmethod
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached block; False if blocks are still in use."""

    @abstractmethod
    def make_stats(self) -> SchedulerStats | None:
        """A stats snapshot, or None when stats are off."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release resources."""
