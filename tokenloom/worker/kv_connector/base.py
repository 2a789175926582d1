"""The worker side of a KV connector: what the model runner calls each step.

The native decoder runs every layer in one call, so a step's loads and saves
are whole blocks over all layers, not layer by layer: a load that the forward
pass needs completes in ``start_load_kv`` before it (asynchronous loads
complete before their request is scheduled at all), and ``save_kv`` runs
after the forward pass wrote the step's KV, handing the copy to a background
thread. A connector that reads blocks in the background must not let the
forward pass overwrite them first: ``blocks_written`` gives the blocks a step
may write, which ``start_load_kv`` waits on when they are still being read.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.outputs import KVConnectorOutput


class KVConnectorWorker(ABC):
    """One per model runner; ``metadata`` is the scheduler side's ``build_connector_meta``."""

    @abstractmethod
    def start_load_kv(self, scheduler_output: SchedulerOutput, metadata: Any) -> None:
        """Before the step's forward pass."""

    @abstractmethod
    def save_kv(self, scheduler_output: SchedulerOutput, metadata: Any) -> None:
        """After the step's forward pass wrote its KV."""

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """What finished since the previous call (loads, held requests, failed blocks)."""

    @property
    def info(self) -> dict[str, Any]:
        """What the scheduler side must know of this side (a producer's bound port)."""
        return {}

    def shutdown(self) -> None:
        """Stop background threads, close sockets."""
        return


def blocks_written(scheduler_output: SchedulerOutput, block_size: int) -> set[int]:
    """The blocks a step may write: those given to requests this step (a block a
    request already held and filled is never written again; a prefix hit's blocks
    are only read)."""
    written: set[int] = set()
    for new in scheduler_output.scheduled_new_reqs:
        written.update(new.block_ids[new.num_computed_tokens // block_size :])
    cached = scheduler_output.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    for i, req_id in enumerate(cached.req_ids):
        block_ids = cached.new_block_ids[i]
        if not block_ids:
            continue
        if req_id in resumed:
            written.update(block_ids[cached.num_computed_tokens[i] // block_size :])
        else:
            written.update(block_ids)
    return written
