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

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _add_dataset_args(p: argparse.ArgumentParser, with_seed: bool) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=["random", "shared-prefix", "jsonl"], default="random")
    g.add_argument(
        "--dataset-path", type=str, default=None, help="JSONL file for --dataset-name jsonl"
    )
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--random-input-len", type=int, default=256)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn from [len*(1-r), len*(1+r)]; 0 means fixed",
    )
    g.add_argument("--input-len-dist", choices=ds.LENGTH_DISTRIBUTIONS, default="uniform")
    g.add_argument("--output-len-dist", choices=ds.LENGTH_DISTRIBUTIONS, default="uniform")
    for which in ("input", "output"):
        g.add_argument(f"--min-{which}-len", type=int, default=None, help="explicit lower bound")
        g.add_argument(f"--max-{which}-len", type=int, default=None, help="explicit upper bound")
    g.add_argument(
        "--prefix-len", type=int, default=400, help="shared-prefix: system prompt tokens"
    )
    g.add_argument("--suffix-len", type=int, default=16, help="shared-prefix: unique tokens")
    g.add_argument("--output-len", type=int, default=64, help="shared-prefix / jsonl default")
    if with_seed:
        g.add_argument("--seed", type=int, default=0)


def _length_spec(args: argparse.Namespace, which: str) -> ds.LengthSpec:
    mean = getattr(args, f"random_{which}_len")
    dist = getattr(args, f"{which}_len_dist")
    lo, hi = getattr(args, f"min_{which}_len"), getattr(args, f"max_{which}_len")
    if lo is None and hi is None:
        return ds.LengthSpec.from_ratio(mean, args.random_range_ratio, dist)
    lo = lo if lo is not None else mean
    hi = hi if hi is not None else mean
    return ds.LengthSpec(dist if lo != hi else "fixed", lo, hi)


def build_requests(
    args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase
) -> list[ds.BenchRequest]:
    """The workload the dataset flags describe."""
    if args.num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {args.num_prompts}")
    if args.dataset_name == "jsonl":
        if not args.dataset_path:
            raise ValueError("dataset_path is required for --dataset-name jsonl")
        return ds.jsonl_requests(
            args.dataset_path,
            lambda s: tokenizer.encode(s, add_special_tokens=False),
            args.output_len,
            args.num_prompts,
        )
    vocab = ds.tokenizer_vocab(tokenizer)
    if args.dataset_name == "shared-prefix":
        return ds.shared_prefix_requests(
            args.num_prompts, args.prefix_len, args.suffix_len, args.output_len, vocab, args.seed
        )
    return ds.random_requests(
        args.num_prompts,
        _length_spec(args, "input"),
        _length_spec(args, "output"),
        vocab,
        args.seed,
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
        ServeConfig,
        format_spec_decoding,
        run_serve_benchmark,
        scrape_spec_counters,
    )
    from tokenloom.bench.stats import format_table

    base_url = args.base_url or f"http://{args.host}:{args.port}"
    tokenizer = ds.load_tokenizer(args.tokenizer)
    requests = build_requests(args, tokenizer)
    cfg = ServeConfig(
        base_url=base_url,
        model=args.served_model,
        endpoint=args.endpoint,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        prompt_as_text=args.prompt_as_text,
        seed=args.seed,
        disable_tqdm=args.disable_tqdm,
    )
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
    import tokenloom
    from tokenloom.bench.offline import format_offline, run_offline, warmup
    from tokenloom.engine.args import EngineArgs

    engine_args = EngineArgs.from_cli_args(args)
    tokenizer = ds.load_tokenizer(args.tokenizer or engine_args.model)
    requests = build_requests(args, tokenizer)
    t0 = time.perf_counter()
    llm = tokenloom.LLM(**{k: v for k, v in asdict(engine_args).items()})
    load_s = time.perf_counter() - t0
    warmup(llm, args.num_warmup)
    result = run_offline(llm, requests)
    print(f"engine load: {load_s:.1f} s (not timed)")
    print(format_offline(result))
    path = _write_json(
        args.result_dir,
        f"offline-{args.dataset_name}-{time.strftime('%Y%m%d-%H%M%S')}",
        {"engine_args": asdict(engine_args), "load_s": load_s, "result": result.to_dict()},
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
    g.add_argument("--endpoint", type=str, default="/v1/completions")
    g.add_argument("--served-model", type=str, default=None, help="default: first of /v1/models")
    g.add_argument("--tokenizer", type=str, default=None, help="HF dir or .gguf (default model)")
    g.add_argument(
        "--request-rate", type=float, default=math.inf, help="req/s, Poisson; inf = all at once"
    )
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos (vLLM/tokenloom extension) so output lengths are fixed",
    )
    g.add_argument("--prompt-as-text", action="store_true", help="send decoded text, not token ids")
    g.add_argument("--result-dir", type=str, default=None, help="write JSON results and PNG plots")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--disable-tqdm", action="store_true")
    _add_dataset_args(serve, with_seed=True)
    serve.set_defaults(func=cmd_serve)

    offline = sub.add_parser("offline", help="throughput of tokenloom.LLM.generate on a workload")
    from tokenloom.engine.args import EngineArgs

    EngineArgs.add_cli_args(offline)  # brings --model and --seed (also the dataset seed)
    offline.add_argument("--tokenizer", type=str, default=None, help="default: --model")
    offline.add_argument("--num-warmup", type=int, default=4, help="untimed warm-up requests")
    offline.add_argument("--result-dir", type=str, default=None)
    _add_dataset_args(offline, with_seed=False)
    offline.set_defaults(func=cmd_offline)
    return bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenloom")
    register_bench_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
