"""Where an engine step's wall time goes on the host: its phases, timed by
wrapping the engine's own functions (an instrument of the benchmarks, not part
of the engine). ``check.py``'s decode section and
``benchmarks/kernels/step_breakdown.py`` use it.

Phases of one step of an in-process engine (``LLM``):

- ``schedule``: ``Scheduler.schedule``;
- ``launch``: the runner's ``execute_model`` (``execute_model_async`` with async
  scheduling): applying the scheduler's deltas, building the step's inputs,
  launching the forward pass and the sampler;
- ``wait``: waiting for the sampled tokens: the synchronous runner's ``_sample``
  (the sampler and the copy of its tokens to the host, which waits for the
  device), or with async scheduling ``PendingOutput.get`` (the copy started at
  launch, and the tokens appended to the batch);
- ``update``: ``Scheduler.update_from_output``;
- ``outputs``: the front end's ``OutputProcessor.process_outputs``
  (detokenizing, request outputs);
- ``other``: the rest of the step's wall time.

``wait`` is nested in ``launch`` for a synchronous step: ``host`` (the wall
time less ``wait``) is the host's work per step either way; on a GPU it is what
the device waits for between steps unless async scheduling hides it behind the
device's own time.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

PHASES = ("schedule", "launch", "wait", "update", "outputs")


class PhaseTimer:
    """Accumulates the wall time of wrapped callables per phase name, per step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.steps: list[dict[str, float]] = []

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - t0
                self.calls[name] += 1

        return timed

    def end_step(self, total: float) -> None:
        step = dict(self.current)
        step["other"] = total - sum(step.values())
        step["total"] = total
        self.steps.append(step)
        self.current = defaultdict(float)

    def reset(self) -> None:
        self.current.clear()
        self.calls.clear()
        self.steps.clear()


@contextlib.contextmanager
def clock_engine(llm: Any) -> Iterator[PhaseTimer]:
    """Time the phases (``PHASES``) of ``llm``'s steps while in the block; the
    engine is restored after it."""
    from tokenloom.worker import async_output

    timer = PhaseTimer()
    core = llm.client.core
    runner = core.runner
    patched: list[tuple[Any, str]] = [
        (core.scheduler, "schedule"),
        (core.scheduler, "update_from_output"),
        (runner, "execute_model"),
        (runner, "execute_model_async"),
        (runner, "_sample"),
        (llm.output_processor, "process_outputs"),
    ]
    names = {
        "schedule": "schedule",
        "update_from_output": "update",
        "execute_model": "launch",
        "execute_model_async": "launch",
        "_sample": "wait_in_launch",
        "process_outputs": "outputs",
    }
    for owner, attr in patched:
        setattr(owner, attr, timer.wrap(names[attr], getattr(owner, attr)))
    get = async_output.PendingOutput.get
    async_output.PendingOutput.get = timer.wrap("wait", get)  # type: ignore[method-assign]
    try:
        yield timer
    finally:
        async_output.PendingOutput.get = get  # type: ignore[method-assign]
        for owner, attr in patched:
            delattr(owner, attr)  # the instance attribute: the class's method again


def per_step_ms(timer: PhaseTimer, wall_s: float) -> dict[str, float]:
    """Each phase's mean ms per step over what ``timer`` saw in ``wall_s`` of
    wall time (steps: the calls of ``schedule``), with ``other`` and ``host``
    (the wall time less ``wait``)."""
    steps = max(timer.calls["schedule"], 1)
    spent = {name: seconds / steps * 1e3 for name, seconds in timer.current.items()}
    phases = {name: spent.get(name, 0.0) for name in PHASES}
    wall_ms = wall_s / steps * 1e3
    phases["other"] = wall_ms - sum(phases.values())
    # A synchronous runner waits inside its launch.
    phases["wait"] += spent.get("wait_in_launch", 0.0)
    phases["host"] = wall_ms - phases["wait"]
    phases["wall"] = wall_ms
    phases["steps"] = steps
    return phases
