"""Single-stream decode speed of the default GGUF: quantized (the default) against
the dequantized float32 and bfloat16 paths.

One request at a time through ``tokenloom.LLM`` (engine overhead included):
a 128-token prompt, ``--output-len`` greedy tokens with ignore_eos; decode
ms/token = (time of the request - time of a 1-token request) / (output-len - 1).
Medians of ``--repeats`` runs, with the resident weight bytes of each path.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/quant_decode.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from tokenloom.engine.llm import LLM
from tokenloom.sampling_params import SamplingParams


def timed(llm: LLM, prompt: list[int], tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["auto", "float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(2)
    prompt = list(range(1000, 1128))
    print(f"load before: {os.getloadavg()[0]:.2f}")
    print("| path | decode ms/token | prefill+1 token ms |")
    print("|---|---:|---:|")
    for dtype in args.dtypes:
        kwargs: dict[str, Any] = {"num_blocks": 64, "max_model_len": 512, "log_stats": False}
        llm = LLM(None, dtype=dtype, **kwargs)
        timed(llm, prompt, 8)  # warm-up
        decode, first = [], []
        for _ in range(args.repeats):
            one = timed(llm, prompt, 1)
            full = timed(llm, prompt, args.output_len)
            first.append(one * 1e3)
            decode.append((full - one) / (args.output_len - 1) * 1e3)
        name = "quantized (auto)" if dtype == "auto" else dtype
        print(f"| {name} | {statistics.median(decode):.1f} | {statistics.median(first):.1f} |")
        del llm
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
