"""Decode steps replayed from CUDA graphs, one graph per batch size of a ladder.

A decode step launches a few hundred small kernels whose launch cost, not the
GPU, would set the pace; a graph replays them all at once. Each graph is
captured over static input buffers, with the attention metadata made of those
buffers alone (``AttentionMetadata.for_kernel``), so a replay only needs the
step's inputs copied in. A batch of ``n`` decodes runs the smallest captured
size ``>= n``; the padding rows are requests of one token that write nothing
(slot -1) and whose outputs are dropped. Graphs share one memory pool,
captured largest first so the smaller ones reuse its blocks.
"""

from __future__ import annotations

import bisect
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from tokenloom.model.attention import AttentionMetadata
from tokenloom.model.llama import CausalLM

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]
# Captures a forward: (what replays it, the output tensor a replay refreshes).
Recorder = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def _cuda_graph(
    forward: Callable[[], torch.Tensor], pool: Any, stream: torch.cuda.Stream
) -> tuple[Callable[[], None], torch.Tensor]:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        output = forward()
    return graph.replay, output


def capture_sizes(max_num_seqs: int, largest: int = 512) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8 up to ``max_num_seqs``
    (at most ``largest``), and ``max_num_seqs`` itself."""
    top = min(max_num_seqs, largest)
    sizes = [s for s in (1, 2, 4) if s <= top]
    sizes += range(8, top + 1, 8)
    if top not in sizes:
        sizes.append(top)
    return sorted(set(sizes))


class DecodeGraphs:
    """Captured decode steps of ``model``; ``serves`` says which steps ``run`` takes."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[KVCache],
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sizes = capture_sizes(max_num_seqs)
        top = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.long, device=device)
        self.block_table = torch.zeros(top, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=device)
        # Every row is one token: the query offsets never change.
        self.query_start = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.replays: dict[int, Callable[[], None]] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata.for_kernel(
            self.query_start[: size + 1],
            self.seq_lens[:size],
            self.block_table[:size],
            self.slot_mapping[:size],
            self.block_size,
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(
            self.input_ids[:size], self.positions[:size], self.kv_caches, self._metadata(size)
        )

    @torch.inference_mode()
    def capture(self, record: Recorder | None = None) -> None:
        """Capture every size (a warm-up run first compiles the kernels for it).
        ``record`` captures one forward (default: a CUDA graph in a pool the sizes
        share); tests pass one that re-runs the forward, to check the buffers on
        the CPU."""
        if record is not None:
            self._capture_all(record)
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._capture_all(functools.partial(_cuda_graph, pool=pool, stream=stream))
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs of decode steps for batch sizes %s", self.sizes)

    def _capture_all(self, record: Recorder) -> None:
        for size in reversed(self.sizes):
            forward = functools.partial(self._forward, size)
            forward()
            self.replays[size], self.outputs[size] = record(forward)

    def serves(self, num_reqs: int, max_query_len: int) -> bool:
        """Whether a step of ``num_reqs`` requests of at most ``max_query_len``
        tokens each (no other inputs) can replay a graph: decodes only, no more than
        the largest size."""
        return max_query_len == 1 and num_reqs <= self.sizes[-1] and bool(self.replays)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """The final hidden states [n, hidden] of a step of ``n`` decodes, whose
        inputs are on the device; ``block_table`` is [n, w] int32, ``seq_lens`` int32."""
        n = input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.block_table[:n, : block_table.shape[1]].copy_(block_table, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        if size > n:  # the padding rows of the previous step may hold real slots
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
        self.replays[size]()
        return self.outputs[size][:n]
