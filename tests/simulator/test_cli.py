"""``tokenloom simulate`` on the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.simulator.test_replay import record
from tokenloom.entrypoints.cli import main


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    record(path)
    return path


def test_simulate_prints_recorded_and_simulated_figures(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "sim.json"
    plot = tmp_path / "sim.png"
    code = main(
        ["simulate", "--trace", str(trace), "--max-num-seqs", "3", "--rate-scale", "2",
         "--plot", str(plot), "--json", str(out_json)]
    )  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert "cost model: step =" in text
    for row in (
        "output throughput (tok/s)",
        "TTFT p50 (ms)",
        "TPOT p99 (ms)",
        "preemptions",
        "KV cache usage mean",
    ):
        assert row in text
    assert "max_num_seqs=3" in text and "rate x2" in text
    payload = json.loads(out_json.read_text())
    assert payload["config"]["max_num_seqs"] == 3 and payload["rate_scale"] == 2.0
    assert payload["recorded"]["num_requests"] == payload["simulated"]["num_requests"] > 0
    assert plot.stat().st_size > 10_000


def test_the_default_plot_lies_beside_the_trace(trace: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run.jsonl"
    copy.write_bytes(trace.read_bytes())
    assert main(["simulate", "--trace", str(copy)]) == 0
    assert (tmp_path / "run.sim.png").is_file()
    assert (
        main(["simulate", "--trace", str(copy), "--no-draw", "--plot", str(tmp_path / "x.png")])
        == 0
    )
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-num-seqs", "0"], "max_num_seqs must be an integer >= 1"),
        (["--rate-scale", "0"], "rate_scale must be a number > 0"),
        (["--policy", "lifo"], "invalid choice"),
    ],
)
def test_bad_settings_are_named(
    trace: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--trace", str(trace), "--no-draw", *args])
    assert message in str(exc.value) + capsys.readouterr().err


def test_a_file_that_is_not_a_trace_is_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--trace FILE is required"):
        main(["simulate"])
    bogus = tmp_path / "notes.txt"
    bogus.write_text("hello\n")
    with pytest.raises(SystemExit, match="notes.txt is not a tokenloom scheduler trace"):
        main(["simulate", "--trace", str(bogus)])
    with pytest.raises(SystemExit, match="cannot read the trace"):
        main(["simulate", "--trace", str(tmp_path / "missing.jsonl")])
