"""tokenloom offline worker (tokenloom.LLM): run with the main venv's python.

See ../_common.py for the protocol. Exits with status 3 and a message when
tokenloom.LLM cannot be imported or built yet.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repo, for tokenloom
from _common import run_all, worker_args  # noqa: E402


def main() -> None:
    ap = worker_args(__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the bundled GGUF")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--quantization", default=None, help="passed on when given")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    try:
        from tokenloom import LLM, SamplingParams
        from tokenloom.bench.offline import reset_prefix_cache
    except Exception as e:  # noqa: BLE001 - report any import failure of a half-built engine
        print(f"tokenloom.LLM is not importable yet: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(3) from None
    config = {
        "model": args.model,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": True,
        "log_stats": False,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    if args.quantization:
        config["quantization"] = args.quantization
    t0 = time.perf_counter()
    llm = LLM(**config)
    load_s = time.perf_counter() - t0
    can_reset = reset_prefix_cache(llm)
    config["prefix_cache_reset_between_runs"] = can_reset
    if not can_reset:
        print("warning: no reset_prefix_cache hook; repeats may hit a warm cache", file=sys.stderr)

    def run_once(workload: list[dict]) -> tuple[list[int], int]:
        prompts = [r["prompt_token_ids"] for r in workload]
        params = [
            SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
            for r in workload
        ]
        outs = llm.generate(prompts, params, use_tqdm=False)
        counts = [len(o.outputs[0].token_ids) for o in outs]
        cached = sum(max(0, int(getattr(o, "num_cached_tokens", 0) or 0)) for o in outs)
        return counts, cached

    def generate_one(prompt: list[int], max_tokens: int) -> int:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return len(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)

    run_all(
        args, run_once, lambda: reset_prefix_cache(llm), "tokenloom", config, load_s, generate_one
    )


if __name__ == "__main__":
    main()
