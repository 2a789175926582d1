"""Which part of the model each tensor-parallel rank holds, and slicing
checkpoint tensors to it (torch-free apart from tensor methods).

Attention is split by KV head: a rank holds a contiguous run of KV heads and
every query head that reads them, so attention needs no communication. Runs
may be uneven (SmolLM2-135M: 3 KV heads over 2 ranks -> 2 + 1, with 6 + 3 query
heads). The MLP's intermediate columns and the vocabulary rows are split into
contiguous, as-even-as-possible ranges. Everything else (norms, RoPE) is
replicated.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tokenloom.model.arch_config import ModelArchConfig

_LAYER_NAME = re.compile(r"^model\.layers\.\d+\.(.+)$")


def split_evenly(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part ``index`` when ``total`` items go to ``parts`` contiguous
    parts, the first ``total % parts`` of them one larger."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of ``world_size``: half-open ranges of what it holds."""

    rank: int
    world_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    head_dim: int

    def local_arch(self, arch: ModelArchConfig) -> ModelArchConfig:
        """The arch the rank's modules are built from: its heads, columns and rows."""
        return dataclasses.replace(
            arch,
            num_attention_heads=_size(self.q_heads),
            num_key_value_heads=_size(self.kv_heads),
            intermediate_size=_size(self.intermediate),
            vocab_size=_size(self.vocab),
        )

    def slice_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], arch: ModelArchConfig
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Hugging Face-named full tensors -> the same names, cut to this rank."""
        for name, tensor in weights:
            yield name, self.slice_weight(name, tensor, arch)

    def slice_weight(self, name: str, tensor: torch.Tensor, arch: ModelArchConfig) -> torch.Tensor:
        rows = self._rows
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return rows(tensor, self.vocab)
        match = _LAYER_NAME.match(name)
        if match is None:
            return tensor
        rest = match.group(1)
        module, _, kind = rest.rpartition(".")
        d = self.head_dim
        q = (self.q_heads[0] * d, self.q_heads[1] * d)
        kv = (self.kv_heads[0] * d, self.kv_heads[1] * d)
        if module == "self_attn.q_proj":
            return rows(tensor, q)
        if module in ("self_attn.k_proj", "self_attn.v_proj"):
            return rows(tensor, kv)
        if module == "self_attn.qkv_proj":  # Phi-3 stores Q, K and V fused
            q_size = arch.num_attention_heads * d
            kv_size = arch.num_key_value_heads * d
            parts = tensor.split((q_size, kv_size, kv_size))
            return _cat((rows(parts[0], q), rows(parts[1], kv), rows(parts[2], kv)))
        if module in ("self_attn.o_proj", "mlp.down_proj") and kind == "bias":
            # Row-parallel outputs are summed over ranks: the bias joins once.
            return tensor if self.rank == 0 else tensor.new_zeros(tensor.shape)
        if module == "self_attn.o_proj":
            return tensor.narrow(1, q[0], q[1] - q[0])
        if module in ("mlp.gate_proj", "mlp.up_proj"):
            return rows(tensor, self.intermediate)
        if module == "mlp.gate_up_proj":  # Phi-3 again
            gate, up = tensor.split(arch.intermediate_size)
            return _cat((rows(gate, self.intermediate), rows(up, self.intermediate)))
        if module == "mlp.down_proj":
            start, end = self.intermediate
            return tensor.narrow(1, start, end - start)
        return tensor

    @staticmethod
    def _rows(tensor: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
        return tensor.narrow(0, span[0], span[1] - span[0])


def _size(span: tuple[int, int]) -> int:
    return span[1] - span[0]


def _cat(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    import torch

    return torch.cat(parts)


def partition(arch: ModelArchConfig, world_size: int, rank: int) -> TPShard:
    """Rank ``rank``'s share; ValueError (naming tensor_parallel_size) if the model
    cannot be split ``world_size`` ways."""
    kv_heads, q_heads = arch.num_key_value_heads, arch.num_attention_heads
    if world_size > kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({world_size}) must not exceed the model's number of KV "
            f"heads ({kv_heads}): each rank holds at least one KV head"
        )
    if q_heads % kv_heads:
        raise ValueError(
            f"tensor_parallel_size > 1 needs the query heads ({q_heads}) to be a multiple of "
            f"the KV heads ({kv_heads})"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    group = q_heads // kv_heads
    kv = split_evenly(kv_heads, world_size, rank)
    return TPShard(
        rank=rank,
        world_size=world_size,
        q_heads=(kv[0] * group, kv[1] * group),
        kv_heads=kv,
        intermediate=split_evenly(arch.intermediate_size, world_size, rank),
        vocab=split_evenly(arch.vocab_size, world_size, rank),
        head_dim=arch.head_dim,
    )
