"""Vision-language serving with the encoder cache on and off: throughput, TTFT and
the share of step time spent in the vision encoder.

``--num-requests`` requests, each one image and a short question, over
``--num-images`` distinct images (each shown by several requests, in a seeded
random order), all submitted at once to an offline ``LLM``, greedy,
``--max-tokens`` out. The question comes before the image, so the prefix cache
cannot share an image's KV between requests: every request needs the image's
encoder output, from the encoder cache or from the tower. The model is a LLaVA
with random weights built here (a CLIP tower of 224-pixel images in 16-pixel
patches: 196 image tokens; a small Llama text model).

Both engines live in this process; runs alternate on, off, off, on, ...
``--repeats`` times each, every repeat with fresh images and an emptied prefix
cache; medians are reported. TTFT is from the ``generate`` call (front-end
image processing included) to the step that gave a request its first token.

    OMP_NUM_THREADS=2 python benchmarks/features/vision_encoder_cache.py --repeats 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import cpu_model  # noqa: E402  (stdlib-only helpers of the benchmarks)

from tests.vl_models import make_llava, random_image  # noqa: E402
from tokenloom import LLM, SamplingParams  # noqa: E402

VISION = dict(
    hidden_size=384,
    intermediate_size=1536,
    num_hidden_layers=6,
    num_attention_heads=6,
    image_size=224,
    patch_size=16,
)
TEXT = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4)
QUESTIONS = ["What is in the picture?", "Describe the colours.", "Is it day or night?",
             "How many objects are there?", "What is on the left?", "Name the main shape.",
             "Is there any text?", "What stands out?"]  # fmt: skip


def workload(repeat: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The requests of one repeat: fresh images (seeded by the repeat), shuffled."""
    images = [random_image(1000 * (repeat + 1) + i, 256, 192) for i in range(args.num_images)]
    order = list(range(args.num_requests))
    random.Random(repeat).shuffle(order)
    return [
        {
            "prompt": f"USER: {QUESTIONS[r % len(QUESTIONS)]} (#{r})\n<image>\nASSISTANT:",
            "multi_modal_data": {"image": images[r % args.num_images]},
        }
        for r in order
    ]


def timed_run(llm: LLM, prompts: list[dict[str, Any]], max_tokens: int) -> dict[str, float]:
    """One pass: wall time, per-request TTFT, and step time inside and outside the tower."""
    mm = llm.client.core.runner.multimodal  # type: ignore[attr-defined]
    encoder_before, encoded_before = mm.encoder_time_s, mm.num_encoded
    first_token: dict[str, float] = {}
    step_s = 0.0
    step = llm.client.step

    def timed_step() -> Any:
        nonlocal step_s
        started = time.perf_counter()
        result = step()
        now = time.perf_counter()
        step_s += now - started
        if result is not None:
            for out in result.outputs.outputs:
                if out.new_token_ids and out.request_id not in first_token:
                    first_token[out.request_id] = now
        return result

    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.client.step = timed_step  # type: ignore[method-assign]
    try:
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
    finally:
        del llm.client.step
    assert len(first_token) == len(prompts), "a request gave no token"
    ttft = sorted(t - started for t in first_token.values())
    encoder_s = mm.encoder_time_s - encoder_before
    return {
        "wall_s": wall,
        "req_per_s": len(prompts) / wall,
        "output_tok_per_s": sum(len(o.outputs[0].token_ids) for o in outputs) / wall,
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": ttft[len(ttft) // 2],
        "ttft_p90_s": ttft[int(len(ttft) * 0.9)],
        "encoder_share": encoder_s / step_s,
        "encoder_s": encoder_s,
        "step_s": step_s,
        "images_encoded": mm.num_encoded - encoded_before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-images", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "llava"
        make_llava(model, vision_sizes=VISION, text_sizes=TEXT)
        engines = {
            on: LLM(str(model), max_model_len=512, enable_encoder_cache=on) for on in (True, False)
        }
        for llm in engines.values():  # untimed warm-up, images the timed runs never show
            llm.generate(workload(-1, args)[:8], SamplingParams(max_tokens=2), use_tqdm=False)
        runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for repeat in range(args.repeats):
            prompts = workload(repeat, args)
            order = (True, False) if repeat % 2 == 0 else (False, True)
            for on in order:
                runs[on].append(timed_run(engines[on], prompts, args.max_tokens))
                print(f"repeat {repeat} cache {'on' if on else 'off'}: {runs[on][-1]}", flush=True)

    print(f"\n{cpu_model()}, torch threads {torch.get_num_threads()}; medians of {args.repeats}")
    keys = ["req_per_s", "output_tok_per_s", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s",
            "encoder_share", "images_encoded", "wall_s"]  # fmt: skip
    print("| encoder cache | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for on in (True, False):
        medians = [statistics.median(run[k] for run in runs[on]) for k in keys]
        cells = [f"{m:.3f}" if isinstance(m, float) else str(m) for m in medians]
        print(f"| {'on' if on else 'off'} | " + " | ".join(cells) + " |")
    # Each repeat ran both back to back: their ratio is the least disturbed by a
    # machine whose speed drifts between repeats.
    ratios = [off["wall_s"] / on["wall_s"] for on, off in zip(runs[True], runs[False], strict=True)]
    print(f"wall off/on per repeat: {', '.join(f'{r:.2f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
