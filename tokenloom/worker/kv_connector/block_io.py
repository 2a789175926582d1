"""Whole KV blocks between the cache tensors and flat bytes.

A block's bytes are its slab in every layer's K then V tensor
(``model/kv_cache.py``: the block index is each tensor's first dimension),
layer by layer: the payload of a disk tier file and of a transfer between
engines. Copies are batched per tensor (one ``index_select`` or
``index_copy_`` per layer and K/V for any number of blocks), so moving a long
prompt's blocks costs a few dozen tensor operations, not thousands.
"""

from __future__ import annotations

import torch


class KVBlockIO:
    """Copies blocks of ``kv_caches`` (``[(K, V)]`` per layer) to and from uint8 tensors."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.tensors = [t for pair in kv_caches for t in pair]
        first = self.tensors[0]
        self.layer_bytes = first[0].numel() * first.element_size()
        for t in self.tensors:
            if t[0].numel() * t.element_size() != self.layer_bytes or not t.is_contiguous():
                raise ValueError("KV cache tensors must be contiguous with equal block slabs")
        self.num_layers = len(kv_caches)
        self.block_bytes = len(self.tensors) * self.layer_bytes
        # Byte views of the CPU cache tensors, so a block's file can be read
        # straight into its slabs (``block_views``) with no copy after the read.
        self.in_host_memory = first.device.type == "cpu"
        self._flat: list[memoryview] = []
        if self.in_host_memory:
            self._flat = [t.view(torch.uint8).reshape(-1).numpy().data for t in self.tensors]

    def block_views(self, block_id: int) -> list[memoryview]:
        """Writable views of the block's slabs in payload order (layer by layer, K
        then V); only where the cache is ``in_host_memory``."""
        if not self.in_host_memory:
            raise ValueError("block_views needs the KV cache in host memory")
        start = block_id * self.layer_bytes
        end = start + self.layer_bytes
        return [flat[start:end] for flat in self._flat]

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """``[len(block_ids), block_bytes]`` uint8 on the CPU: the blocks' bytes."""
        n = len(block_ids)
        out = torch.empty((n, len(self.tensors), self.layer_bytes), dtype=torch.uint8)
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.tensors[0].device)
        for j, t in enumerate(self.tensors):
            slab = t.index_select(0, index)
            out[:, j, :].view(t.dtype).view(n, *t.shape[1:]).copy_(slab)
        return out.view(n, self.block_bytes)

    def scatter(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write ``data`` (``[len(block_ids), block_bytes]`` uint8) into the blocks."""
        n = len(block_ids)
        if tuple(data.shape) != (n, self.block_bytes) or data.dtype != torch.uint8:
            raise ValueError(f"expected {n} blocks of {self.block_bytes} bytes, got {data.shape}")
        view = data.view(n, len(self.tensors), self.layer_bytes)
        device = self.tensors[0].device
        index = torch.tensor(block_ids, dtype=torch.int64, device=device)
        for j, t in enumerate(self.tensors):
            source = view[:, j, :].view(t.dtype).view(n, *t.shape[1:])
            t.index_copy_(0, index, source.to(device))
