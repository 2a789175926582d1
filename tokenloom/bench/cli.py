"""``tokenloom bench serve`` and ``tokenloom bench offline``.

The main ``tokenloom`` command calls :func:`register_bench_commands` with its
subparsers; each leaf parser sets ``func`` (``args -> exit code``). Also
runnable on its own: ``python -m tokenloom.bench.cli bench serve ...``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from tokenloom.bench import datasets as ds
from tokenloom.bench.config import DatasetArgs, ServeConfig
from tokenloom.options import add_cli_args, build

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _length_spec(d: DatasetArgs, which: str) -> ds.LengthSpec:
    mean = getattr(d, f"random_{which}_len")
    dist = getattr(d, f"{which}_len_dist")
    lo, hi = getattr(d, f"min_{which}_len"), getattr(d, f"max_{which}_len")
    if lo is None and hi is None:
        return ds.LengthSpec.from_ratio(mean, d.random_range_ratio, dist)
    lo = lo if lo is not None else mean
    hi = hi if hi is not None else mean
    return ds.LengthSpec(dist if lo != hi else "fixed", lo, hi)


def build_requests(
    args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase
) -> list[ds.BenchRequest]:
    """The workload the dataset flags (``DatasetArgs``) describe."""
    d = build(DatasetArgs, vars(args))
    if d.dataset_name == "jsonl":
        if not d.dataset_path:
            raise ValueError("dataset_path is required for --dataset-name jsonl")
        return ds.jsonl_requests(
            d.dataset_path,
            lambda s: tokenizer.encode(s, add_special_tokens=False),
            d.output_len,
            d.num_prompts,
        )
    vocab = ds.tokenizer_vocab(tokenizer)
    if d.dataset_name == "shared-prefix":
        return ds.shared_prefix_requests(
            d.num_prompts, d.prefix_len, d.suffix_len, d.output_len, vocab, d.seed
        )
    return ds.random_requests(
        d.num_prompts, _length_spec(d, "input"), _length_spec(d, "output"), vocab, d.seed
    )


def _write_json(result_dir: str | None, name: str, payload: dict) -> Path | None:
    if not result_dir:
        return None
    out = Path(result_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def cmd_serve(args: argparse.Namespace) -> int:
    from tokenloom.bench.serve import (
        format_spec_decoding,
        run_serve_benchmark,
        scrape_spec_counters,
    )
    from tokenloom.bench.stats import format_table

    base_url = args.base_url or f"http://{args.host}:{args.port}"
    tokenizer = ds.load_tokenizer(args.tokenizer)
    requests = build_requests(args, tokenizer)
    cfg = build(ServeConfig, vars(args), base_url=base_url, seed=args.seed)
    spec_before = scrape_spec_counters(base_url)
    metrics, results, model = run_serve_benchmark(
        requests, cfg, decode=lambda ids: cast(str, tokenizer.decode(ids))
    )
    print(format_table(metrics, f"Serving benchmark: {model} @ {base_url}"))
    spec_after = scrape_spec_counters(base_url) if spec_before is not None else None
    if spec_before is not None and spec_after is not None:
        line = format_spec_decoding(spec_before, spec_after)
        if line is not None:
            print(line)
    for r in results:
        if not r.success:
            print(f"first failure: {r.error}")
            break
    name = f"serve-{args.dataset_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    rate = "inf" if math.isinf(args.request_rate) else args.request_rate
    path = _write_json(
        args.result_dir,
        name,
        {
            "config": {
                **asdict(cfg),
                "request_rate": rate,
                "dataset": vars(args).get("dataset_name"),
            },
            "model": model,
            "metrics": metrics.to_dict(),
            "requests": [asdict(r) for r in results],
        },
    )
    if path is not None:
        print(f"results: {path}")
        if not args.no_plots:
            from tokenloom.bench.plots import plot_serve_results

            for p in plot_serve_results(results, args.result_dir, name):
                print(f"plot: {p}")
    return 0 if metrics.failed == 0 else 1


def cmd_offline(args: argparse.Namespace) -> int:
    from tokenloom.bench.offline import format_offline, run_offline, warmup
    from tokenloom.engine.args import EngineArgs
    from tokenloom.engine.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    tokenizer = ds.load_tokenizer(args.tokenizer or engine_args.model)
    requests = build_requests(args, tokenizer)
    t0 = time.perf_counter()
    llm = LLM.from_engine_args(engine_args)
    load_s = time.perf_counter() - t0
    warmup(llm, args.num_warmup)
    result = run_offline(llm, requests)
    print(f"engine load: {load_s:.1f} s (not timed)")
    print(format_offline(result))
    path = _write_json(
        args.result_dir,
        f"offline-{args.dataset_name}-{time.strftime('%Y%m%d-%H%M%S')}",
        {"engine_args": engine_args.as_kwargs(), "load_s": load_s, "result": result.to_dict()},
    )
    if path is not None:
        print(f"results: {path}")
    if result.total_output_tokens != result.expected_output_tokens:
        print("warning: the engine returned a different number of tokens than requested")
        return 1
    return 0


def register_bench_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench serve`` and ``bench offline`` to a ``tokenloom`` subparsers object."""
    bench = subparsers.add_parser("bench", help="benchmark a server or the offline engine")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    serve = sub.add_parser("serve", help="load-test an OpenAI-compatible /v1/completions server")
    g = serve.add_argument_group("server")
    g.add_argument("--base-url", type=str, default=None, help="overrides --host/--port")
    g.add_argument("--host", type=str, default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--tokenizer", type=str, default=None, help="HF dir or .gguf (default model)")
    g.add_argument("--result-dir", type=str, default=None, help="write JSON results and PNG plots")
    g.add_argument("--no-plots", action="store_true")
    add_cli_args(serve, ServeConfig, title="load")
    add_cli_args(serve, DatasetArgs, title="dataset")
    serve.set_defaults(func=cmd_serve)

    offline = sub.add_parser("offline", help="throughput of tokenloom.LLM.generate on a workload")
    from tokenloom.engine.args import EngineArgs

    EngineArgs.add_cli_args(offline)  # brings --model and --seed (also the dataset seed)
    offline.add_argument("--tokenizer", type=str, default=None, help="default: --model")
    offline.add_argument("--num-warmup", type=int, default=4, help="untimed warm-up requests")
    offline.add_argument("--result-dir", type=str, default=None)
    # The engine's --seed seeds the workload too.
    add_cli_args(offline, DatasetArgs, title="dataset", skip=("seed",))
    offline.set_defaults(func=cmd_offline)
    return bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenloom")
    register_bench_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
