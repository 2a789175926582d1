"""Batch-1 decode of two checkouts of tokenloom, turn about, both loaded at once.

This VM's memory bandwidth moves by a quarter from one minute to the next, more
than most changes move a batch-1 step, so runs of whole processes one after
the other (``compare_peers.py --tokenloom-base``) compare minutes as much as
code. Here each checkout loads the model once in its own process (so each
imports its own code and native library), and the two then take turns: one
pair of requests (a 1-token and a 32-token request, 128-token prompts, greedy)
in one, then a pair in the other, the order reversed every turn, while the
other waits idle. Decode ms/token = (time of 32 tokens - time of 1) / 31, and
each turn gives one ratio of the two; prompts differ in every request, so the
prefix cache never serves one.

The other checkout is a git worktree of an earlier commit whose native library
is built in place (``python setup.py build_ext --inplace`` there, with this
venv's python on PATH; commits before the build step compile theirs on import).

    git worktree add /tmp/base <commit>
    (cd /tmp/base && PATH=$OLDPWD/.venv/bin:$PATH TOKENLOOM_BUILD_VARIANTS=host python setup.py build_ext --inplace)
    .venv/bin/python benchmarks/kernels/batch1_ab.py --base /tmp/base --model .bench/gguf/llama-1b-random-Q4_K_M.gguf --turns 40
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPT_TOKENS = 128
DECODE_TOKENS = 32


def serve_turns(model: str | None, threads: int) -> None:
    """The worker: load once, then time one pair of requests per seed read from stdin."""
    import torch

    torch.set_num_threads(threads)
    from tokenloom import LLM, SamplingParams

    llm = LLM(model, max_model_len=512)
    vocab = 32000

    def timed(max_tokens: int, seed: int) -> float:
        prompt = [(7 * i + 100 + seed) % vocab for i in range(PROMPT_TOKENS)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    timed(4, -1)
    print("ready", flush=True)
    for line in sys.stdin:
        seed = 2 * int(line)
        one, many = timed(1, seed), timed(DECODE_TOKENS, seed + 1)
        print(f"{(many - one) / (DECODE_TOKENS - 1) * 1e3:.4f}", flush=True)


def start_worker(tree: Path, model: str | None, threads: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--threads", str(threads)]
    if model:
        cmd += ["--model", str(Path(model).resolve())]
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(threads))
    proc = subprocess.Popen(
        cmd, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == "ready":
            return proc
    raise SystemExit(f"the worker of {tree} exited before it was ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, help="the other checkout (required unless --worker)")
    ap.add_argument("--model", default=None, help="default: the bundled GGUF")
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        serve_turns(args.model, args.threads)
        return
    if args.base is None:
        ap.error("--base is required")
    workers = {
        "base": start_worker(args.base.resolve(), args.model, args.threads),
        "this": start_worker(ROOT, args.model, args.threads),
    }
    ms: dict[str, list[float]] = {name: [] for name in workers}
    for turn in range(args.turns):
        for name in ("base", "this") if turn % 2 == 0 else ("this", "base"):
            proc = workers[name]
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(f"{turn}\n")
            proc.stdin.flush()
            ms[name].append(float(proc.stdout.readline()))
    for proc in workers.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    ratios = [this / base for this, base in zip(ms["this"], ms["base"], strict=True)]
    print(f"model {args.model or 'default'}; base {args.base}; {args.turns} turns")
    for name in ("base", "this"):
        values = ms[name]
        print(
            f"  {name}: decode ms/token median {statistics.median(values):.2f} "
            f"(quartiles {statistics.quantiles(values, n=4)[0]:.2f}-"
            f"{statistics.quantiles(values, n=4)[2]:.2f})"
        )
    faster = sum(r < 1 for r in ratios)
    print(
        f"  this / base per turn: median {statistics.median(ratios):.3f}; "
        f"this faster in {faster} of {len(ratios)} turns"
    )


if __name__ == "__main__":
    main()
