"""The tensor-parallel process group: one per worker process, all ranks of one
engine core (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

# A rank waits this long in a collective for the others before failing.
_TIMEOUT = datetime.timedelta(minutes=10)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, device: torch.device
) -> None:
    """Join the group (blocks until every rank has joined)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device),
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=_TIMEOUT,
    )


def tensor_parallel_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tensor_parallel_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
