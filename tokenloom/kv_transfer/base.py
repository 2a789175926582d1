"""The scheduler side of a KV connector (seed 004's interface, vLLM's names).

The scheduler calls a connector at four points of a request's life:

1. Admission. After the in-memory prefix lookup,
   ``get_num_new_matched_tokens(request, num_computed_tokens)`` says how many
   further tokens the external store holds and whether they load
   asynchronously; after the blocks are allocated,
   ``update_state_after_alloc(request, blocks, num_external_tokens)`` tells the
   connector where they go. A request whose load is asynchronous waits as
   ``WAITING_FOR_REMOTE_KVS``, holding its blocks, without blocking the
   requests behind it; a synchronous load completes before this step's
   forward pass.
2. End of ``schedule()``. ``build_connector_meta(scheduler_output)`` returns
   what the workers must load and save this step; it rides on the
   ``SchedulerOutput`` as ``kv_connector_metadata``.
3. ``update_from_output``. ``update_connector_output(output)`` receives the
   worker side's ``KVConnectorOutput``: finished loads and sends, blocks that
   failed to load (recomputed, never served), and the worker's own news.
4. Finish. ``request_finished(request, block_ids)`` may delay the free of a
   finished request's blocks (they are being saved or sent; the worker later
   reports the request in ``finished_sending``) and returns the
   ``kv_transfer_params`` for the request's final output.

Nothing here imports torch or the scheduler: ``core`` imports this module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tokenloom.outputs import KVConnectorOutput, KVTransferStats

if TYPE_CHECKING:
    from tokenloom.request import Request

__all__ = [
    "BlockList",
    "KVCacheSpec",
    "KVConnectorBase",
    "KVConnectorOutput",
    "KVTransferStats",
]


class BlockList(Protocol):
    """The blocks handed to ``update_state_after_alloc`` (the manager's ``KVCacheBlocks``)."""

    def get_block_ids(self) -> list[int]: ...


@dataclass(frozen=True)
class KVCacheSpec:
    """What a connector must know of the engine's KV cache.

    ``fingerprint`` (hex) identifies what a block's bytes mean: the model's
    weights, the compute and KV cache dtypes, the block size and the cache
    layout. KV with another fingerprint is never loaded. ``description`` says
    the same for people (log lines). ``layer_bytes``: bytes of one block of
    one layer's K (and as many of its V).
    """

    fingerprint: str
    description: str
    block_size: int
    num_layers: int
    layer_bytes: int

    @property
    def bytes_per_block(self) -> int:
        """One block's K and V over every layer."""
        return 2 * self.num_layers * self.layer_bytes


class KVConnectorBase(ABC):
    """Scheduler side of a KV connector. One instance per engine core.

    Subclasses implement the four abstract methods; ``update_connector_output``,
    ``take_stats`` and ``shutdown`` default to doing nothing.
    """

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens of ``request`` the external store holds beyond ``num_computed_tokens``
        (the in-memory prefix hit), and whether they load asynchronously.

        ``(None, False)``: the connector cannot tell yet; the request keeps its
        place and is asked again in a later step.
        """

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: BlockList, num_external_tokens: int
    ) -> None:
        """``blocks``: every block of ``request`` (the prefix hit's, then the new ones);
        the external tokens go into those after the first ``num_computed_tokens``
        given to ``get_num_new_matched_tokens``. Called for every admitted
        request, with 0 external tokens when there is nothing to load."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """What the worker side must do this step (loads, saves), given the step's
        ``SchedulerOutput``; the connector forgets it once returned."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker side's report of the step (before the scheduler acts on it)."""
        return

    @abstractmethod
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request`` finished (any reason, aborts included) holding ``block_ids``.

        Returns whether to delay freeing the blocks (the worker side then reports
        the request in ``finished_sending`` or ``finished_recving`` when they
        may go) and the ``kv_transfer_params`` for its final output.
        """

    def take_stats(self) -> KVTransferStats | None:
        """The scheduler side's counts since the previous call (None: nothing to add)."""
        return None

    def shutdown(self) -> None:
        """Release what the connector holds (files, sockets)."""
        return
