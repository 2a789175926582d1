"""A fixed ragged-batch scenario covering the attention paths.

Four sequences over block size 4:
  step 1: B prefill chunk 1 (12), A full prefill (7), D prefill (5) whose first
          block is A's first block (a prefix hit on a block written this step);
  step 2: C prefill (3), A decode, B chunk 2 (8, after 12 cached), D decode
          (decodes not contiguous in the batch);
  step 3: decodes A, B, C, D; step 4: decodes D, B, C, A; step 5: C, B.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tests.model.harness import BlockAllocator, Seq, run_step

BLOCK_SIZE = 4


def make_sequences(vocab_size: int, seed: int = 0) -> dict[str, Seq]:
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(0, vocab_size, (n,), generator=g).tolist()

    a = rand(10)
    return {"A": Seq(a), "B": Seq(rand(23)), "C": Seq(rand(6)), "D": Seq(a[:4] + rand(8))}


def run_scenario(
    model: torch.nn.Module,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    seqs: dict[str, Seq],
    native_op: Callable[..., None] | None = None,
) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """Returns per sequence a list of (first position, logits rows) computed."""
    alloc = BlockAllocator(BLOCK_SIZE)
    a, b, c, d = seqs["A"], seqs["B"], seqs["C"], seqs["D"]
    alloc.ensure(a, 7)
    d.block_ids = [a.block_ids[0]]
    d.num_computed = 4  # prefix-cache hit on A's first (full) block
    steps = [
        [(b, 12), (a, 7), (d, 5)],
        [(c, 3), (a, 1), (b, 8), (d, 1)],
        [(a, 1), (b, 1), (c, 1), (d, 1)],
        [(d, 1), (b, 1), (c, 1), (a, 1)],
        [(c, 1), (b, 1)],
    ]
    names = {id(seq): name for name, seq in seqs.items()}
    results: dict[str, list[tuple[int, torch.Tensor]]] = {name: [] for name in seqs}
    for schedule in steps:
        starts = [seq.num_computed for seq, _ in schedule]
        for (seq, _), start, logits in zip(
            schedule, starts, run_step(model, kv_caches, alloc, schedule, native_op), strict=True
        ):
            results[names[id(seq)]].append((start, logits))
    for name, seq in seqs.items():
        assert seq.num_computed == len(seq.tokens), name
    return results


def max_abs_diff(
    results: dict[str, list[tuple[int, torch.Tensor]]],
    reference: dict[str, torch.Tensor],
) -> float:
    """Largest |ours - reference| over every computed row."""
    worst = 0.0
    for name, chunks in results.items():
        for start, logits in chunks:
            ref = reference[name][start : start + logits.shape[0]]
            worst = max(worst, (logits - ref).abs().max().item())
    return worst
