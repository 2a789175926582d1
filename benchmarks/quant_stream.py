"""How fast the one-row kernel streams a real model's quantized weights from memory.

Loads a GGUF (default: the bundled model), then calls every ``QuantLinear`` once
per pass with one activation row, in model order, as a batch-1 decode step does:
a model larger than the caches is read from DRAM each pass. Prints, per matrix
kind (name, bits, group, shape), the time per pass, the bytes read and GB/s;
medians of ``--passes`` passes.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/quant_stream.py [--model FILE.gguf]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from tokenloom.config import ModelConfig
from tokenloom.model_loader.loader import load_model
from tokenloom.quantization.kernels import native_available, quant_matmul
from tokenloom.quantization.linear import QuantLinear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file; default: the bundled model")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert native_available(), "the native kernel did not build"
    model = load_model(ModelConfig(model=args.model)).model
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    inputs = {id(m): torch.randn(1, m.in_features) for _, m in layers}
    seconds: dict[tuple, list[float]] = defaultdict(list)
    sizes: dict[tuple, int] = defaultdict(int)
    for p in range(args.passes):
        per_pass: dict[tuple, float] = defaultdict(float)
        for name, m in layers:
            w = m.qweight
            kind = (name.split(".")[-1], w.bits, w.group, (w.out_features, w.in_features))
            t0 = time.perf_counter()
            quant_matmul(inputs[id(m)], w)
            per_pass[kind] += time.perf_counter() - t0
            if p == 0:
                sizes[kind] += w.nbytes
        for kind, s in per_pass.items():
            seconds[kind].append(s)
    print(f"{args.threads} threads, medians of {args.passes} passes")
    print("| matrix | bits | group | (out, in) | ms per pass | MB | GB/s |")
    print("|---|---:|---:|---|---:|---:|---:|")
    total_s = 0.0
    for kind, runs in seconds.items():
        s = statistics.median(runs)
        total_s += s
        name, bits, group, shape = kind
        print(
            f"| {name} | {bits} | {group} | {list(shape)} | {s * 1e3:.2f} | "
            f"{sizes[kind] / 1e6:.1f} | {sizes[kind] / s / 1e9:.1f} |"
        )
    total = sum(sizes.values())
    print(f"all: {total_s * 1e3:.2f} ms, {total / 1e6:.1f} MB, {total / total_s / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
