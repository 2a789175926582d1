"""Hugging Face transformers worker: static batching with left padding.

Run with the main venv's python; see ../_common.py for the protocol. Requests
are taken in workload order in batches of ``--batch-size``; each batch
decodes to its longest ``max_tokens`` (EOS suppressed with min_new_tokens),
and each request is credited only the tokens it asked for: the surplus is
the padding waste static batching pays. One process per batch size.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
from _common import run_all, worker_args  # noqa: E402


def main() -> None:
    ap = worker_args(__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF model directory")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-size", type=int, required=True)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model: Any = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model.eval()
    load_s = time.perf_counter() - t0
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    @torch.inference_mode()
    def run_once(workload: list[dict]) -> tuple[list[int], int]:
        counts: list[int] = []
        for i in range(0, len(workload), args.batch_size):
            batch = workload[i : i + args.batch_size]
            width = max(len(r["prompt_token_ids"]) for r in batch)
            new = max(r["max_tokens"] for r in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, r in enumerate(batch):
                p = r["prompt_token_ids"]
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            out: Any = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad_id,
            )
            generated = out.shape[1] - width
            counts += [min(generated, r["max_tokens"]) for r in batch]
        return counts, 0

    import transformers

    config = {
        "model": args.model,
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "transformers_version": transformers.__version__,
        "threads": args.threads,
    }
    run_all(args, run_once, lambda: None, f"hf-bs{args.batch_size}", config, load_s)


if __name__ == "__main__":
    main()
