"""Decode steps as two micro-batches (each one's attention beside the other's
projections, ``forward_split`` in ``csrc/decoder/decoder_stack.cpp``) against
the whole batch, alternating in one process.

DECODES requests of PROMPT tokens (greedy) run through the real Scheduler and
ModelRunner; after their prefill and a warm-up, blocks of ``--block`` decode
steps alternate between the two ways (the stack's ``overlap_decodes_from``
switched between 2 and 0), the order reversed each round, so both see the same
minutes of a shared host and nearly the same contexts. Prints the median of the
rounds' ratios (overlapped block median over whole block median) with its
quartiles, and each way's median step.

    .venv/bin/python benchmarks/kernels/overlap_ab.py --model .bench/smollm2-hf-bf16 --decodes 64 --prompt 200
    .venv/bin/python benchmarks/kernels/overlap_ab.py --decodes 32     # the default GGUF
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenloom.config import CacheConfig, ModelConfig, SchedulerConfig
from tokenloom.core.sched.scheduler import Scheduler
from tokenloom.request import Request
from tokenloom.sampling_params import SamplingParams
from tokenloom.worker.model_runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled GGUF")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--decodes", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    max_tokens = 2 * args.rounds * args.block + 64
    cache = CacheConfig(
        block_size=16,
        num_blocks=args.decodes * (args.prompt + max_tokens + 16) // 16 + 16,
    )
    sched_config = SchedulerConfig(max_num_seqs=args.decodes)
    runner = ModelRunner(
        ModelConfig(model=args.model, dtype=args.dtype, max_model_len=4096), cache, sched_config
    )
    stack = runner.model.decoder_stack
    if stack is None:
        raise SystemExit("this model runs without the native decoder stack")
    scheduler = Scheduler(sched_config, cache, runner.max_model_len)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    vocab = runner.arch.vocab_size
    for r in range(args.decodes):
        prompt = [(7 * i + 100 + 13 * r) % vocab for i in range(args.prompt)]
        scheduler.add_request(
            Request(f"r{r}", prompt, params, eos_token_id=runner.eos_token_ids[0])
        )

    def step() -> int:
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner.execute_model(out))
        return out.total_num_scheduled_tokens

    while step() != args.decodes:  # the prompts
        pass
    for _ in range(5):
        step()
    ratios: list[float] = []
    steps: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        block_medians = {}
        for overlapped in (False, True) if r % 2 == 0 else (True, False):
            stack.stack.overlap_decodes_from(2 if overlapped else 0)
            times = []
            for _ in range(args.block):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            block_medians[overlapped] = statistics.median(times)
            steps[overlapped] += times
        ratios.append(block_medians[True] / block_medians[False])
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    print(
        f"{args.decodes} decodes over {args.prompt}+ tokens, {args.threads} threads: "
        f"overlapped / whole {statistics.median(ratios):.3f} (quartiles {q1:.3f}-{q3:.3f}); "
        f"whole {1e3 * statistics.median(steps[False]):.2f} ms, "
        f"overlapped {1e3 * statistics.median(steps[True]):.2f} ms a step"
    )


if __name__ == "__main__":
    main()
