"""The scheduler's bookkeeping for a KV connector (``tokenloom.kv_transfer``).

The scheduler owns one ``ConnectorState`` when it was given a connector and
calls it at the points ``kv_transfer.base`` describes; without a connector
none of this runs. It keeps:

* the requests loading asynchronously (``WAITING_FOR_REMOTE_KVS``): they stay
  in the waiting queue, holding their blocks, which are not cached (no other
  request may hit a block still being written); when the worker reports the
  load finished, ``ready`` caches the valid prefix and the request is
  admitted like any other, its ``num_computed_tokens`` covering what loaded;
* the finished requests whose blocks the connector holds (being saved or
  sent, or still being written by a load when the request was aborted): they
  are freed when the worker reports them in ``finished_sending`` or
  ``finished_recving``;
* what blocks that failed to load mean: an asynchronous load stops at the
  first failed block and the rest is recomputed; a request that already ran
  on a failed synchronous load (or on a block another request loaded) is
  preempted and recomputes, and failed blocks leave the prefix cache.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tokenloom.core.kv_cache.manager import KVCacheManager
from tokenloom.kv_transfer.base import KVConnectorBase
from tokenloom.outputs import KVConnectorOutput, KVTransferStats
from tokenloom.request import Request, RequestStatus

logger = logging.getLogger(__name__)

_LOADING = RequestStatus.WAITING_FOR_REMOTE_KVS


@dataclass
class _Load:
    """An asynchronous load: the request's status before it, the tokens its prefix
    hit and the load cover, and the index of its first failed block (if any)."""

    prior_status: RequestStatus
    num_local: int
    num_external: int
    first_invalid: int | None = None


class ConnectorState:
    """One scheduler's view of its connector's transfers."""

    def __init__(self, connector: KVConnectorBase, manager: KVCacheManager) -> None:
        self.connector = connector
        self.manager = manager
        self.block_size = manager.block_size
        self.loading: dict[str, _Load] = {}
        # Loads the worker reported finished, not yet picked up by admission.
        self.loaded: set[str] = set()
        # Finished requests whose blocks are held for the connector.
        self.held: dict[str, Request] = {}
        self.stats = KVTransferStats()

    def has_pending(self) -> bool:
        """Transfers still to report: the engine must keep stepping the worker side."""
        return bool(self.loading) or bool(self.held)

    # ------------------------------------------------------------------ admission

    def match(self, request: Request, num_local: int) -> tuple[int, bool] | None:
        """``(external tokens, asynchronous)`` for a request with ``num_local`` tokens
        hit in memory; None when the connector asks to be asked again later."""
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
        if num_external is None:
            return None
        if not num_external:
            return 0, False
        num_tokens = request.num_tokens
        if num_external < 0 or num_local + num_external > num_tokens:
            raise RuntimeError(
                f"KV connector matched {num_external} tokens of request "
                f"{request.request_id!r} after {num_local} computed, of {num_tokens}"
            )
        if not load_async and num_local + num_external >= num_tokens:
            # This step must compute at least the last token, to sample.
            num_external = num_tokens - 1 - num_local
            if num_external <= 0:
                return 0, False
        return num_external, load_async

    def after_alloc(
        self, request: Request, num_local: int, num_external: int, load_async: bool
    ) -> None:
        """Blocks were allocated for ``request``; an asynchronous load parks it."""
        self.connector.update_state_after_alloc(
            request, self.manager.get_blocks(request.request_id), num_external
        )
        if load_async:
            self.loading[request.request_id] = _Load(request.status, num_local, num_external)
            request.status = _LOADING
        elif num_external:
            self._count(request, num_external)

    def ready(self, request: Request) -> bool:
        """For a ``WAITING_FOR_REMOTE_KVS`` request: once its load finished, cache what
        loaded, set ``num_computed_tokens`` to it, and restore its status."""
        req_id = request.request_id
        if req_id not in self.loaded:
            return False
        self.loaded.discard(req_id)
        load = self.loading.pop(req_id)
        num_valid = load.num_local + load.num_external
        if load.first_invalid is not None:
            num_valid = min(num_valid, load.first_invalid * self.block_size)
            self.stats.num_recomputed_tokens += load.num_local + load.num_external - num_valid
            logger.warning(
                "request %s: KV load failed from block %d; recomputing from token %d",
                req_id,
                load.first_invalid,
                num_valid,
            )
        if num_valid >= request.num_tokens:
            num_valid = request.num_tokens - 1  # the last token is computed, to sample
        request.status = load.prior_status
        if num_valid <= 0:
            # Nothing usable: start over (the retry may hit the prefix cache).
            self.manager.free(request)
            num_valid = 0
        else:
            self.manager.cache_blocks(request, num_valid)
        request.num_computed_tokens = num_valid
        self._count(request, max(num_valid - load.num_local, 0))
        return True

    def reclaim(self, waiting: Iterable[Request], keep: Request) -> bool:
        """Free the blocks of the last waiting request (other than ``keep``) holding
        loaded KV; it starts over when admitted. False if there is none."""
        for request in reversed(list(waiting)):
            if request is keep:
                continue
            if request.status == _LOADING and not self.ready(request):
                continue  # its load may still write its blocks
            if not request.num_computed_tokens:
                continue
            logger.info(
                "request %s gives back its loaded KV: the cache is full with nothing running",
                request.request_id,
            )
            self.manager.free(request)
            request.num_computed_tokens = 0
            return True
        return False

    def _count(self, request: Request, num_hit: int) -> None:
        self.stats.num_queried_tokens += request.num_tokens
        self.stats.num_hit_tokens += num_hit

    # ------------------------------------------------------------------ finish

    def finish(self, request: Request) -> dict[str, Any] | None:
        """A request finished (any reason): free its blocks unless the connector holds
        them. Returns its ``kv_transfer_params``."""
        req_id = request.request_id
        delay, params = self.connector.request_finished(request, self.manager.get_block_ids(req_id))
        still_loading = req_id in self.loading and req_id not in self.loaded
        self.loading.pop(req_id, None)
        self.loaded.discard(req_id)
        if delay or still_loading:
            # A load still writing its blocks must end before anyone else gets them.
            self.held[req_id] = request
        else:
            self.manager.free(request)
        return params

    # ------------------------------------------------------------------ outputs

    def before_output(
        self, output: KVConnectorOutput, running: Iterable[Request], waiting: Iterable[Request]
    ) -> list[Request]:
        """The worker side's report, before the step's tokens are applied: the
        connector hears it first, then failed blocks are dealt with. Returns the
        running requests that computed on a failed block (to preempt)."""
        self.connector.update_connector_output(output)
        if output.kv_connector_stats is not None:
            self.stats.merge(output.kv_connector_stats)
        if not output.invalid_block_ids:
            return []
        return self._invalidate(output.invalid_block_ids, running, waiting)

    def _invalidate(
        self, invalid_block_ids: set[int], running: Iterable[Request], waiting: Iterable[Request]
    ) -> list[Request]:
        """Blocks that failed to load leave the prefix cache; loads stop at their
        first failed block; waiting requests holding one start over. Returns the
        running requests that computed on one."""
        manager = self.manager
        manager.drop_cached_blocks(invalid_block_ids)
        affected: list[Request] = []
        for request in running:
            if _first_in(manager.get_block_ids(request.request_id), invalid_block_ids) is not None:
                affected.append(request)
        for request in waiting:
            block_ids = manager.get_block_ids(request.request_id)
            first = _first_in(block_ids, invalid_block_ids)
            if first is None:
                continue
            load = self.loading.get(request.request_id)
            if load is not None:
                if load.first_invalid is None or first < load.first_invalid:
                    load.first_invalid = first
            else:
                # Loaded earlier, waiting to run: it has not used the KV yet.
                manager.free(request)
                request.num_computed_tokens = 0
        if affected:
            self.stats.num_recomputed_tokens += sum(r.num_computed_tokens for r in affected)
            logger.warning(
                "KV load failed for %d block(s); recomputing request(s) %s",
                len(invalid_block_ids),
                ", ".join(r.request_id for r in affected),
            )
        return affected

    def after_output(self, output: KVConnectorOutput) -> None:
        """Finished loads and sends of the step, once its finished requests are known."""
        for req_id in output.finished_recving or ():
            held = self.held.pop(req_id, None)
            if held is not None:
                self.manager.free(held)
            elif req_id in self.loading:
                self.loaded.add(req_id)
        for req_id in output.finished_sending or ():
            held = self.held.pop(req_id, None)
            if held is not None:
                self.manager.free(held)

    def take_stats(self) -> KVTransferStats:
        stats = self.stats
        own = self.connector.take_stats()
        if own is not None:
            stats.merge(own)
        self.stats = KVTransferStats()
        return stats


def _first_in(block_ids: list[int], wanted: set[int]) -> int | None:
    for i, block_id in enumerate(block_ids):
        if block_id in wanted:
            return i
    return None
