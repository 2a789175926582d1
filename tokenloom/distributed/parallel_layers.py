"""Turn a model built from a rank's ``TPShard.local_arch`` into its share of the
whole: the few places where ranks must talk.

The local model's q/k/v and gate/up matmuls already are column-parallel (they
only have the rank's heads and columns) and its attention runs on its own KV
heads. What remains is to sum the row-parallel outputs (``o_proj``,
``down_proj``) over the ranks, to look up embeddings in the rank's vocabulary
rows and sum, and to gather every rank's vocabulary slice of the logits. The
original modules stay inside the wrappers (MKL-packed or swapped as they
were), so this runs last, after loading.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.distributed.communication import all_gather_last_dim, all_reduce
from tokenloom.distributed.shard import TPShard, split_evenly
from tokenloom.model.llama import CausalLM


class RowParallel(nn.Module):
    """``inner`` over the rank's input columns, summed over the ranks."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Embedding):
    """Embedding rows ``[start, end)`` of the vocabulary; a token outside them
    contributes zeros, and the sum over the ranks is the full lookup."""

    def __init__(self, weight: torch.Tensor, vocab: tuple[int, int]) -> None:
        # The loaded weight's storage (a tied LM head reads it too).
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight)
        self.requires_grad_(False)
        self.start, self.end = vocab

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        inside = (input_ids >= self.start) & (input_ids < self.end)
        local_ids = torch.where(inside, input_ids - self.start, 0)
        h = F.embedding(local_ids, self.weight)
        h.masked_fill_(~inside.unsqueeze(-1), 0)
        return all_reduce(h)


class GatheredLogits(nn.Module):
    """The rank's vocabulary slice of the logits, gathered into the full row."""

    def __init__(self, weight: torch.Tensor, head: nn.Module | None, sizes: list[int]) -> None:
        super().__init__()
        self.weight = weight
        self.head = head  # the MKL-packed head when there is one
        self.sizes = sizes

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            local = self.head(hidden)
        else:
            local = F.linear(hidden, self.weight)
        return all_gather_last_dim(local, self.sizes)


def parallelize(model: CausalLM, shard: TPShard, full_vocab_size: int) -> None:
    """Insert the collectives into a loaded local model (see the module docstring)."""
    for layer in model.layers:
        for path in ("self_attn.o_proj", "mlp.down_proj"):
            parent, _, name = path.rpartition(".")
            module = layer.get_submodule(parent)
            setattr(module, name, RowParallel(module.get_submodule(name)))
    embedding = model.embed_tokens.weight
    head_weight = embedding if model.lm_head is None else model.lm_head.weight
    sizes = [
        end - start
        for start, end in (
            split_evenly(full_vocab_size, shard.world_size, r) for r in range(shard.world_size)
        )
    ]
    model.logits_head = GatheredLogits(head_weight, model.logits_head, sizes)
    model.embed_tokens = VocabParallelEmbedding(embedding, shard.vocab)
