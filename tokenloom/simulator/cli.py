"""``tokenloom simulate``: what a recorded workload would do under another configuration.

It reads a scheduler trace (``--record-trace``), replays it exactly to check
it and to fit the step-cost model to the recorded steps, then runs the same
requests through the real ``Scheduler`` with the settings given (any not
given keep the trace's) and arrivals ``--rate-scale`` times as fast. It prints
the recorded run beside the simulated one, and draws both.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.core.sched.trace import read_trace
from tokenloom.options import add_cli_args, build, option, option_specs, validate

# The trace's settings a simulation may change, by the engine flags that set them.
OVERRIDES: dict[str, type] = {
    "max_num_seqs": SchedulerConfig,
    "max_num_batched_tokens": SchedulerConfig,
    "enable_chunked_prefill": SchedulerConfig,
    "long_prefill_token_threshold": SchedulerConfig,
    "policy": SchedulerConfig,
    "num_blocks": CacheConfig,
    "enable_prefix_caching": CacheConfig,
}


@dataclass(frozen=True)
class SimulateArgs:
    """The trace to simulate and how to change its arrivals."""

    trace: str | None = option(
        None, metavar="FILE", help="the scheduler trace to replay, written by --record-trace"
    )
    rate_scale: float = option(
        1.0, gt=0, help="arrivals come this many times as fast as recorded (2: twice the traffic)"
    )
    plot: str | None = option(
        None, metavar="PNG", help="where to draw the runs (default: beside the trace, .sim.png)"
    )
    draw: bool = option(True, help="draw the runs (--no-draw: print only)")
    json_path: str | None = option(
        None, arg="json", metavar="FILE", help="also write the figures as JSON"
    )

    def __post_init__(self) -> None:
        validate(self)


def add_simulate_args(parser: argparse.ArgumentParser) -> None:
    add_cli_args(parser, SimulateArgs, title="simulation")
    group = parser.add_argument_group("scheduler", "settings to change (default: the trace's)")
    for arg, cls in OVERRIDES.items():
        [spec] = [s for s in option_specs(cls) if s.arg == arg]
        kwargs = spec.argparse_kwargs()
        kwargs.update(default=None, help=spec.option.help)
        group.add_argument(*spec.flags, **kwargs)


def cmd_simulate(args: argparse.Namespace) -> int:
    from tokenloom.simulator.replay import replay, simulate, with_overrides
    from tokenloom.simulator.report import format_table, plot_runs, summarize

    try:
        sim = build(SimulateArgs, vars(args))
        if sim.trace is None:
            raise ValueError("--trace FILE is required: a scheduler trace (--record-trace)")
        trace = read_trace(sim.trace)
        config = with_overrides(trace.config, **{arg: getattr(args, arg) for arg in OVERRIDES})
        config.scheduler_config()  # validated here, with the flag's name in the message
        config.cache_config()
        recorded = replay(trace)
    except ValueError as exc:
        raise SystemExit(f"tokenloom simulate: {exc}") from None
    model = recorded.fit_cost_model()
    simulated = simulate(trace, model, config, sim.rate_scale)
    changes = [
        f"{arg}={getattr(config, arg)}"
        for arg in OVERRIDES
        if getattr(config, arg) != getattr(trace.config, arg)
    ]
    if sim.rate_scale != 1.0:
        changes.append(f"rate x{sim.rate_scale:g}")
    label = "simulated" + (f" ({', '.join(changes)})" if changes else "")
    print(f"trace: {sim.trace}: {len(trace.arrivals)} requests, {len(trace.steps)} steps")
    print(f"cost model: {model.describe()}")
    recorded_summary = summarize(recorded.run)
    simulated_summary = summarize(simulated)
    print(format_table([("recorded", recorded_summary), ("simulated", simulated_summary)]))
    if changes:
        print(f"simulated: {label}")
    if sim.json_path:
        payload: dict[str, Any] = {
            "trace": sim.trace,
            "config": {arg: getattr(config, arg) for arg in OVERRIDES},
            "rate_scale": sim.rate_scale,
            "cost_model": {"coefficients": model.coefficients, "step_gap_s": model.step_gap_s},
            "recorded": recorded_summary.to_dict(),
            "simulated": simulated_summary.to_dict(),
        }
        Path(sim.json_path).write_text(json.dumps(payload, indent=2))
    if sim.draw:
        path = Path(sim.plot) if sim.plot else Path(sim.trace).with_suffix(".sim.png")
        try:
            plot_runs([("recorded", recorded.run), (label, simulated)], path)
        except ImportError:
            print("no plot: matplotlib is not installed (pip install tokenloom[bench])")
        else:
            print(f"plot: {path}")
    return 0


def register_simulate_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``simulate`` to a ``tokenloom`` subparsers object."""
    parser = subparsers.add_parser(
        "simulate",
        help="replay a scheduler trace (--record-trace) under another configuration, no model",
    )
    add_simulate_args(parser)
    parser.set_defaults(func=cmd_simulate)
    return parser
