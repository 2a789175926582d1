"""Data parallel flags, their validation, and the per-core ``engine`` metrics label."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tokenloom.engine.args import EngineArgs
from tokenloom.metrics.prometheus import PrometheusStatLogger
from tokenloom.metrics.stats import IterationStats
from tokenloom.outputs import SchedulerStats


def test_cli_flags_reach_the_configs() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["-dp", "2", "--data-parallel-backend", "ray", "--dp-load-balance", "round_robin"]
        + ["--dp-load-margin", "3"]
    )
    config = EngineArgs.from_cli_args(args).config
    parallel = config.parallel_config
    assert (parallel.data_parallel_size, parallel.data_parallel_backend) == (2, "ray")
    balance = config.load_balance_config
    assert (balance.policy, balance.load_margin) == ("round_robin", 3)
    defaults = EngineArgs().config
    assert defaults.parallel_config.data_parallel_size == 1
    assert defaults.load_balance_config.policy == "prefix"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"data_parallel_size": 0}, "data_parallel_size"),
        ({"data_parallel_size": "2"}, "data_parallel_size"),
        ({"data_parallel_backend": "slurm"}, "data_parallel_backend"),
        ({"dp_load_balance": "random"}, "dp_load_balance"),
        ({"dp_load_margin": -1}, "dp_load_margin"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        EngineArgs(**kwargs)  # type: ignore[arg-type]


def test_metrics_carry_an_engine_label_with_data_parallel() -> None:
    registry = CollectorRegistry()
    stat_logger = PrometheusStatLogger("m", registry, num_engines=2)
    stat_logger.record(SchedulerStats(num_running_reqs=3), IterationStats(engine_index=1))
    stat_logger.record(SchedulerStats(num_running_reqs=5), IterationStats(engine_index=0))
    text = generate_latest(registry).decode()
    assert 'tokenloom:num_requests_running{engine="1",model_name="m"} 3.0' in text
    assert 'tokenloom:num_requests_running{engine="0",model_name="m"} 5.0' in text
    # Both cores' series exist from the start.
    assert (
        'tokenloom:request_success_total{engine="1",finished_reason="stop",model_name="m"}' in text
    )


def test_one_engine_keeps_the_plain_labels() -> None:
    registry = CollectorRegistry()
    PrometheusStatLogger("m", registry).record(SchedulerStats(num_running_reqs=2), IterationStats())
    text = generate_latest(registry).decode()
    assert 'tokenloom:num_requests_running{model_name="m"} 2.0' in text
    assert "engine=" not in text


def test_llm_refuses_data_parallel_naming_the_field() -> None:
    from tokenloom.engine.llm import LLM

    with pytest.raises(ValueError, match="^data_parallel_size"):
        LLM(data_parallel_size=2)
