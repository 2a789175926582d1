"""Plot files are written; the CLI parses and builds the workloads it describes."""

from __future__ import annotations

import argparse

import pytest

from tokenloom.bench.cli import build_requests, register_bench_commands
from tokenloom.bench.plots import plot_serve_results, plot_throughput_bars
from tokenloom.bench.stats import RequestResult

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_serve_plots_written(tmp_path):
    results = [
        RequestResult(
            True, 10, 4, ttft=0.1 * i, e2e=0.5 + 0.1 * i, itl=[0.1, 0.12, 0.13], start_time=0.05 * i
        )
        for i in range(1, 20)
    ] + [RequestResult(False, 3, error="x")]
    paths = plot_serve_results(results, tmp_path / "plots", "run1")
    assert len(paths) == 2
    for p in paths:
        assert p.exists() and p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 1000


def test_bar_chart_written(tmp_path):
    rows = [("tokenloom", "main", 120.0), ("vllm", "main", 300.0), ("vllm", "shared-prefix", 250.0)]
    path = plot_throughput_bars(rows, tmp_path / "bars.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


class FakeTokenizer:
    all_special_ids = [0, 1, 2]
    added_tokens_decoder: dict = {}

    def __len__(self) -> int:
        return 500

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + (ord(c) % 400) for c in text]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tokenloom")
    register_bench_commands(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_random_dataset_with_explicit_bounds():
    args = parse(
        [
            "bench",
            "serve",
            "--num-prompts",
            "20",
            "--min-input-len",
            "8",
            "--max-input-len",
            "16",
            "--input-len-dist",
            "log-uniform",
            "--random-output-len",
            "5",
            "--seed",
            "3",
        ]
    )
    assert args.func.__name__ == "cmd_serve"
    reqs = build_requests(args, FakeTokenizer())
    assert len(reqs) == 20
    assert all(8 <= r.prompt_len <= 16 and r.max_tokens == 5 for r in reqs)
    assert all(3 <= t < 500 for r in reqs for t in r.prompt_token_ids)
    assert reqs == build_requests(args, FakeTokenizer())


def test_cli_shared_prefix_and_jsonl(tmp_path):
    args = parse(
        [
            "bench",
            "serve",
            "--dataset-name",
            "shared-prefix",
            "--num-prompts",
            "4",
            "--prefix-len",
            "30",
            "--suffix-len",
            "2",
            "--output-len",
            "7",
        ]
    )
    reqs = build_requests(args, FakeTokenizer())
    assert [r.prompt_len for r in reqs] == [32] * 4 and reqs[0].prompt_token_ids[:30] == reqs[
        3
    ].prompt_token_ids[:30]
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "abc", "max_tokens": 2}\n')
    args = parse(["bench", "serve", "--dataset-name", "jsonl", "--dataset-path", str(path)])
    (req,) = build_requests(args, FakeTokenizer())
    assert req.max_tokens == 2 and req.prompt == "abc" and req.prompt_len == 3
    args = parse(["bench", "serve", "--dataset-name", "jsonl"])
    with pytest.raises(ValueError, match="dataset_path"):
        build_requests(args, FakeTokenizer())


def test_bad_dataset_flags_name_the_argument():
    with pytest.raises(ValueError, match=r"^num_prompts must be an integer >= 1, got 0"):
        build_requests(parse(["bench", "serve", "--num-prompts", "0"]), FakeTokenizer())


def test_cli_offline_has_engine_flags():
    args = parse(["bench", "offline", "--num-prompts", "3", "--max-num-seqs", "8", "--seed", "5"])
    assert args.func.__name__ == "cmd_offline"
    assert args.max_num_seqs == 8 and args.seed == 5
    reqs = build_requests(args, FakeTokenizer())
    assert len(reqs) == 3
