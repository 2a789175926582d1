"""Throughput of one batch mixing LoRA adapters against the base model alone.

Both runs generate the same number of tokens from prompts of the same length
(random token ids, ``ignore_eos``, greedy) on one engine started with
``enable_lora``; the mixed run spreads the prompts round-robin over
``--num-adapters`` random rank-``--rank`` adapters on every attention and MLP
projection (written as PEFT directories, no peft needed). Runs alternate base,
mixed, base, ... ``--repeats`` times each; the medians are reported.

    python benchmarks/features/lora_mixed.py --num-prompts 32 --prompt-len 32 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenloom import LLM, SamplingParams
from tokenloom.lora_request import LoRARequest
from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.model.arch_reader import load_arch_config
from tokenloom.model.peft_config import expected_shapes
from tokenloom.model_loader.loader import resolve_model_path

MODULES = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def write_adapter(path: Path, arch: ModelArchConfig, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter on every projection of ``arch``."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for block, names in MODULES.items():
            for name in names:
                shapes = expected_shapes(arch, name, rank)
                assert shapes is not None
                prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(*shapes[0], generator=g) * 0.02
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(*shapes[1], generator=g) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": [n for names in MODULES.values() for n in names],
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    arch = load_arch_config(resolve_model_path(args.model))
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, arch.vocab_size - 100, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = []
        for i in range(args.num_adapters):
            write_adapter(Path(tmp) / f"adapter{i}", arch, args.rank, seed=i)
            adapters.append(LoRARequest(f"adapter{i}", i + 1, str(Path(tmp) / f"adapter{i}")))
        llm = LLM(
            args.model,
            enable_lora=True,
            max_loras=args.num_adapters,
            max_lora_rank=args.rank,
            max_num_seqs=args.num_prompts,
            enable_prefix_caching=False,
            log_stats=False,
        )
        per_prompt = [adapters[i % len(adapters)] for i in range(args.num_prompts)]
        # Warm-up: one short run of each kind (loads the adapters into their slots).
        warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        llm.generate(prompts, warm, use_tqdm=False)
        llm.generate(prompts, warm, use_tqdm=False, lora_request=per_prompt)
        times: dict[str, list[float]] = {"base": [], "mixed": []}
        for _ in range(args.repeats):
            for kind in ("base", "mixed"):
                start = time.perf_counter()
                outs = llm.generate(
                    prompts,
                    params,
                    use_tqdm=False,
                    lora_request=per_prompt if kind == "mixed" else None,
                )
                times[kind].append(time.perf_counter() - start)
                assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
    tokens = args.num_prompts * args.output_len
    base, mixed = statistics.median(times["base"]), statistics.median(times["mixed"])
    print(
        f"{args.num_prompts} prompts x {args.prompt_len} in / {args.output_len} out, "
        f"{args.num_adapters} adapters of rank {args.rank}, medians of {args.repeats}"
    )
    print(f"base model only : {base:6.2f} s  {tokens / base:7.1f} output tok/s")
    print(f"mixed adapters  : {mixed:6.2f} s  {tokens / mixed:7.1f} output tok/s")
    print(f"mixed / base    : {base / mixed:.2f}x")
    print("runs (s):", {k: [round(t, 2) for t in v] for k, v in times.items()})


if __name__ == "__main__":
    main()
