"""Paged attention on the CPU, for the two choices ``model/attention.py`` and
``model/kv_cache.py`` make: where the KV cache's pages come from, and which
prompt chunks the native kernel takes.

- ``decode``: REQUESTS decodes of CONTEXT tokens each, their blocks scattered
  over the cache as a busy engine leaves them, one call per layer over LAYERS
  layers' caches (so that they come from DRAM, as in a real step). The caches
  are ``torch.zeros`` (4 KB pages) or ``huge_pages.zeros`` (2 MB pages where
  the kernel grants them), float32 and bfloat16. Reported: ms per layer and
  the K/V bytes read per second.
- ``prefill``: one 2,048-token step of fresh prompts, lengths log-uniform in
  32-512 as in compare_peers' main workload, per layer: the native kernel in
  one call, against SDPA once per chunk (the path chunks longer than
  ``NATIVE_MAX_QUERY`` take).

Each round times every variant once (best of ``--repeats`` calls); the table is
the median of ``--rounds`` rounds, side by side. The default model's heads: 9
query heads, 3 KV heads of 64.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/attention_kernels.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenloom.model import huge_pages  # noqa: E402
from tokenloom.ops.cpu_kernels import paged_attention_op  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def decode_case(
    op: Callable[..., None],
    requests: int,
    context: int,
    layers: int,
    dtype: torch.dtype,
    huge: bool,
) -> tuple[Callable[[], object], int]:
    """One layer-by-layer pass of ``requests`` decodes; returns it and the bytes it reads."""
    per_request = -(-context // BLOCK)
    num_blocks = requests * per_request + 1
    alloc = huge_pages.zeros if huge else (lambda s, d, dev: torch.zeros(s, dtype=d, device=dev))
    caches = []
    for _ in range(layers):
        k = alloc((num_blocks, KV_HEADS, HEAD_DIM, BLOCK), dtype, "cpu")
        v = alloc((num_blocks, KV_HEADS, BLOCK, HEAD_DIM), dtype, "cpu")
        k.copy_(torch.randn(k.shape))
        v.copy_(torch.randn(v.shape))
        caches.append((k, v))
    generator = torch.Generator().manual_seed(0)
    table = torch.randperm(num_blocks - 1, generator=generator)[: requests * per_request]
    table = table.add(1).to(torch.int32).view(requests, per_request)
    q = torch.randn(requests, HEADS, HEAD_DIM)
    out = torch.empty_like(q)
    rows, ones = int32(list(range(requests))), int32([1] * requests)
    seq_lens = int32([context] * requests)

    def run() -> None:
        for k, v in caches:
            op(out, q, k, v, table, rows, rows, ones, seq_lens, SCALE)

    kv_bytes = 2 * requests * context * KV_HEADS * HEAD_DIM * k.element_size()
    return run, kv_bytes * layers


def prompt_step(seed: int) -> tuple[list[int], torch.Tensor, int]:
    """A 2,048-token step of fresh prompt chunks, lengths log-uniform in 32-512:
    the lengths, their block table (each chunk's blocks in a row from block 1)
    and the number of blocks a cache for them needs."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < 2048:
        drawn = int(math.exp(rng.uniform(math.log(32), math.log(512))))
        lengths.append(min(drawn, 2048 - sum(lengths)))
    blocks = [-(-n // BLOCK) for n in lengths]
    table = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    first = 1
    for row, n in enumerate(blocks):
        table[row, :n] = torch.arange(first, first + n)
        first += n
    return lengths, table, first


def prefill_case(op: Callable[..., None], seed: int) -> dict[str, Callable[[], object]]:
    """A 2,048-token step of fresh chunks: the native kernel in one call, SDPA per chunk."""
    lengths, table, num_blocks = prompt_step(seed)
    k_cache = torch.randn(num_blocks, KV_HEADS, HEAD_DIM, BLOCK)
    v_cache = torch.randn(num_blocks, KV_HEADS, BLOCK, HEAD_DIM)
    tokens = sum(lengths)
    q = torch.randn(tokens, HEADS, HEAD_DIM)
    out = torch.empty_like(q)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    args = (
        out, q, k_cache, v_cache, table, int32(list(range(len(lengths)))),
        int32(starts), int32(lengths), int32(lengths), SCALE,
    )  # fmt: skip
    chunks = [
        (
            q[s : s + n].transpose(0, 1)[None],
            torch.randn(1, KV_HEADS, n, HEAD_DIM),
            torch.randn(1, KV_HEADS, n, HEAD_DIM),
        )
        for s, n in zip(starts, lengths, strict=True)
    ]

    def sdpa() -> None:
        for qc, kc, vc in chunks:
            F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=SCALE, enable_gqa=True)

    print(f"prefill step: {len(lengths)} chunks, {tokens} tokens, longest {max(lengths)}")
    return {"native, one call": lambda: op(*args), "SDPA per chunk": sdpa}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    op = paged_attention_op(torch.device("cpu"), torch.float32, HEAD_DIM)
    if op is None:
        sys.exit("the native CPU kernels are unavailable")
    print(f"threads {torch.get_num_threads()}")

    decode = {}
    for dtype in (torch.float32, torch.bfloat16):
        for huge in (False, True):
            name = f"decode {str(dtype).removeprefix('torch.')}, {'2 MB' if huge else '4 KB'} pages"
            decode[name] = decode_case(op, args.requests, args.context, args.layers, dtype, huge)
    prefill = prefill_case(op, seed=0)

    results: dict[str, list[float]] = {name: [] for name in [*decode, *prefill]}
    for _ in range(args.rounds):
        for name, (run, _) in decode.items():
            results[name].append(best_ms(run, args.repeats) / args.layers)
        for name, run in prefill.items():
            results[name].append(best_ms(run, args.repeats))

    print(
        f"\n{args.requests} decodes of {args.context} tokens; medians of {args.rounds} rounds\n"
        "| case | ms per layer | K/V read GB/s |\n|---|---:|---:|"
    )
    for name, times in results.items():
        ms = statistics.median(times)
        rate = ""
        if name in decode:
            rate = f"{decode[name][1] / args.layers / (ms / 1e3) / 1e9:.1f}"
        print(f"| {name} | {ms:.2f} | {rate} |")


if __name__ == "__main__":
    main()
