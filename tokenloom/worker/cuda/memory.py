"""The KV cache's share of a GPU under ``--gpu-memory-utilization`` (vLLM's meaning).

The engine may use ``utilization x total memory``: the weights (already
loaded), the peak of a step's activations, measured by running the largest step
the scheduler can build once over a one-block cache, and what the process holds
outside PyTorch's allocator (the CUDA context, libraries). The KV cache gets
what is left.
"""

from __future__ import annotations

import torch

from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.model.attention import AttentionMetadata
from tokenloom.model.kv_cache import allocate_kv_caches
from tokenloom.model.llama import CausalLM


@torch.inference_mode()
def profile_step_peak(
    model: CausalLM,
    arch: ModelArchConfig,
    num_tokens: int,
    num_logits_rows: int,
    block_size: int,
    kv_dtype: torch.dtype,
    device: torch.device,
    use_kernel: bool,
) -> int:
    """Peak bytes allocated while running one fresh prompt of ``num_tokens`` tokens
    and the logits of ``num_logits_rows`` rows, the weights included. Its K/V all
    go to the null block's slot 0, so a one-block cache serves it. ``use_kernel``:
    attention by the Triton kernel, else by torch."""
    caches = allocate_kv_caches(model.arch, 1, block_size, kv_dtype, device)
    table = torch.zeros(1, -(-num_tokens // block_size), dtype=torch.int32, device=device)
    slots = torch.zeros(num_tokens, dtype=torch.long, device=device)
    if use_kernel:
        meta = AttentionMetadata.for_kernel(
            torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
            torch.tensor([num_tokens], dtype=torch.int32, device=device),
            table,
            slots,
            block_size,
        )
    else:
        meta = AttentionMetadata.build([num_tokens], [num_tokens], table, slots, block_size)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device) % arch.max_position_embeddings
    rows = torch.arange(min(num_logits_rows, num_tokens), device=device)
    hidden = model(ids, positions, caches, meta, keep_rows=rows)
    model.compute_logits(hidden)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def kv_cache_budget(utilization: float, step_peak: int, device: torch.device) -> int:
    """Bytes the KV cache may take: ``utilization`` of the GPU's memory, less the
    profiled step's peak (weights included) and the memory held outside PyTorch."""
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = total - free - torch.cuda.memory_reserved(device)
    return int(utilization * total) - step_peak - max(outside_torch, 0)
