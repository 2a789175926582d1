"""vLLM (CPU build) worker: run with .bench/vllm/bin/python; see ../_common.py for the protocol.

Expects VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE and VLLM_CACHE_ROOT
in the environment (compare_peers.py sets them).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
from _common import run_all, worker_args  # noqa: E402


def main() -> None:
    ap = worker_args(__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF model directory")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    config = {
        "model": args.model,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": True,
        "seed": 0,
    }
    llm = LLM(**config)
    load_s = time.perf_counter() - t0

    def run_once(workload: list[dict]) -> tuple[list[int], int]:
        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in workload]
        params = [
            SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
            for r in workload
        ]
        outs = llm.generate(prompts, params, use_tqdm=False)
        counts = [len(o.outputs[0].token_ids) for o in outs]
        cached = sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outs)
        return counts, cached

    def reset() -> None:
        llm.reset_prefix_cache()

    def generate_one(prompt: list[int], max_tokens: int) -> int:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return len(out[0].outputs[0].token_ids)

    import vllm

    config["vllm_version"] = vllm.__version__
    run_all(args, run_once, reset, "vllm", config, load_s, generate_one)


if __name__ == "__main__":
    main()
