"""Drive a tokenloom model like the runner does: ragged batches over a paged cache.

Each ``Seq`` has its whole token sequence fixed in advance (teacher forcing),
so every logit row we compute can be compared with a reference model's logits
at the same position of the full sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tokenloom.model.attention import AttentionMetadata


@dataclass
class Seq:
    tokens: list[int]
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0


class BlockAllocator:
    """Hands out block ids from 1 (0 is the reserved null block)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.next_id = 1

    def ensure(self, seq: Seq, num_tokens: int) -> None:
        while len(seq.block_ids) * self.block_size < num_tokens:
            seq.block_ids.append(self.next_id)
            self.next_id += 1


def run_step(
    model: torch.nn.Module,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    allocator: BlockAllocator,
    schedule: list[tuple[Seq, int]],
    native_op: Callable[..., None] | None = None,
    keep_rows: list[int] | None = None,
) -> list[torch.Tensor]:
    """Run one step; returns, per scheduled seq, logits [n_new, vocab] (float32),
    or with ``keep_rows`` (rows of the step's flat batch) one tensor of those rows'."""
    bs = allocator.block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    for seq, n in schedule:
        start, end = seq.num_computed, seq.num_computed + n
        allocator.ensure(seq, end)
        ids += seq.tokens[start:end]
        positions += list(range(start, end))
        slots += [seq.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
        query_lens.append(n)
        seq_lens.append(end)
    max_blocks = max(len(seq.block_ids) for seq, _ in schedule) + 1  # +1: padding column
    table = torch.zeros(len(schedule), max_blocks, dtype=torch.int32)
    for i, (seq, _) in enumerate(schedule):
        table[i, : len(seq.block_ids)] = torch.tensor(seq.block_ids, dtype=torch.int32)
    meta = AttentionMetadata.build(
        query_lens, seq_lens, table, torch.tensor(slots, dtype=torch.long), bs, native_op
    )
    with torch.inference_mode():
        keep = None if keep_rows is None else torch.tensor(keep_rows, dtype=torch.long)
        hidden = model(torch.tensor(ids), torch.tensor(positions), kv_caches, meta, keep_rows=keep)
        logits = model.compute_logits(hidden)
    for seq, n in schedule:
        seq.num_computed += n
    return [logits] if keep_rows is not None else list(logits.split(query_lens))
