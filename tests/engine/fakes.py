"""A model runner without a model, for driving EngineCore (and the engines on it) in tests."""

from __future__ import annotations

from typing import Any

from tests.core.utils import FakeRunner
from tokenloom.metrics.stats import IterationStats
from tokenloom.outputs import SchedulerStats


class FakeModelRunner:
    """The runner surface EngineCore uses (``ModelRunnerProtocol``); every token is ``token``."""

    def __init__(self, num_blocks: int, max_model_len: int = 128, token: int = 7) -> None:
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.fake = FakeRunner(token_source=lambda _req_id: token)
        self.calls: list[Any] = []

    def execute_model(self, scheduler_output: Any) -> Any:
        self.calls.append(scheduler_output)
        return self.fake.execute(scheduler_output)

    def remove_lora(self, lora_int_id: int) -> bool:
        self.calls.append(("remove_lora", lora_int_id))
        return False


class DyingRunner(FakeModelRunner):
    """Fails (like a crashed core) after ``steps_to_live`` steps; None: never. Steps
    count from the one that brings its ``after_requests``-th request, so that a test
    knows which requests the core held when it died, however slowly they arrived."""

    def __init__(self, token: int, steps_to_live: int | None, after_requests: int = 0) -> None:
        super().__init__(num_blocks=64, max_model_len=128, token=token)
        self.steps_to_live = steps_to_live
        self.after_requests = after_requests
        self.requests_seen: set[str] = set()
        self.steps_lived = 0

    def execute_model(self, scheduler_output: Any) -> Any:
        self.requests_seen.update(new.req_id for new in scheduler_output.scheduled_new_reqs)
        if self.steps_to_live is not None and len(self.requests_seen) >= self.after_requests:
            if self.steps_lived >= self.steps_to_live:
                self.calls.append(scheduler_output)  # what it was asked to do when it died
                raise RuntimeError("core crashed")
            self.steps_lived += 1
        return super().execute_model(scheduler_output)


class RestartCounter:
    """A stat logger that counts engine core restarts (crash recovery)."""

    def __init__(self) -> None:
        self.restarts = 0
        # The engine index each counted start attempt was reported under.
        self.restarted_engines: list[int] = []

    def record(self, _: SchedulerStats | None, iteration: IterationStats | None) -> None:
        if iteration is not None and iteration.num_engine_restarts:
            self.restarts += iteration.num_engine_restarts
            self.restarted_engines.append(iteration.engine_index)
