"""``OffloadingConnector``, scheduler side: a persistent disk tier of full KV blocks.

Every full block a request computes is written to the tier (write-through,
by the worker side after the step's forward pass, off its critical path),
named by its content key (``keys``); so a block evicted from memory, or lost
with a restarted engine, is still on disk. When a request is admitted, the
blocks after its in-memory prefix hit that the tier holds are loaded
asynchronously into its blocks (the request waits as
``WAITING_FOR_REMOTE_KVS``, not blocking others) instead of being computed.

The tier's index (``disk_tier.DiskTierIndex``) lives here: it answers
lookups, reserves room for each save (evicting the least recently used
blocks, whose files the worker deletes) and learns from the worker side
which saves reached the disk, which failed (a full disk shrinks the budget)
and which files were found corrupt or truncated (dropped and recomputed).
A key another request is loading makes a request wait (``None``) rather
than load the same block twice: once loaded, it hits in memory; so does a
key whose file is being written, rather than compute the block again.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec

from tokenloom.kv_transfer.base import BlockList, KVCacheSpec, KVConnectorBase
from tokenloom.kv_transfer.block_file import file_bytes
from tokenloom.kv_transfer.disk_tier import DiskTierIndex
from tokenloom.kv_transfer.keys import BlockKeys, chain_root
from tokenloom.outputs import KVConnectorOutput, KVTransferStats

if TYPE_CHECKING:
    from tokenloom.request import Request

logger = logging.getLogger(__name__)


class OffloadMeta(msgspec.Struct):
    """One step's work for the worker side: loads by request (``(block id, key)``
    each, in order), saves after the forward pass, and files to delete first."""

    loads: dict[str, list[tuple[int, str]]]
    saves: list[tuple[int, str]]
    deletes: list[str]


class OffloadFeedback(msgspec.Struct):
    """What the worker side tells the index: keys saved, saves failed, files found
    unusable (already deleted), and whether a save found the disk full."""

    saved: list[str] = []
    failed: list[str] = []
    bad: list[str] = []
    disk_full: bool = False


class _Tracked:
    """A live request: its keys, its blocks (as the runner has them), how many of
    its blocks were considered for saving, and its in-memory hit at admission."""

    __slots__ = ("request", "keys", "block_ids", "num_checked", "num_local", "loading", "in_flight")

    def __init__(self, request: Request, root: bytes) -> None:
        self.request = request
        self.keys = BlockKeys(root)
        self.block_ids: list[int] = []
        self.num_checked = 0
        self.num_local = 0
        # Keys of its latest load: pinned in the index while ``in_flight``, and
        # claimed (other requests wait for them) until it runs.
        self.loading: list[str] = []
        self.in_flight = False


class OffloadingConnector(KVConnectorBase):
    """The disk tier's scheduler side; ``root`` is ``--kv-offload-dir``."""

    def __init__(self, spec: KVCacheSpec, root: str, capacity_bytes: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.index = DiskTierIndex(root, spec, capacity_bytes)
        self._file_bytes = file_bytes(spec)
        self._roots: dict[tuple[str, str] | None, bytes] = {None: chain_root(spec.fingerprint)}
        self._tracked: dict[str, _Tracked] = {}
        # Keys being loaded -> requests loading them.
        self._loading_keys: dict[str, int] = {}
        # Loads of requests that finished (aborted) before their load did.
        self._orphan_loads: dict[str, list[str]] = {}
        self._loads: dict[str, list[tuple[int, str]]] = {}
        self._deletes: list[str] = []
        self._stats = KVTransferStats()
        if self.index.num_foreign_files:
            self._stats.errors["foreign"] = self.index.num_foreign_files

    def _track(self, request: Request) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            lora = request.lora_request
            name = None if lora is None else (lora.lora_name, lora.lora_path)
            root = self._roots.get(name)
            if root is None:
                root = self._roots[name] = chain_root(self.spec.fingerprint, lora)
            tracked = self._tracked[request.request_id] = _Tracked(request, root)
        return tracked

    # ------------------------------------------------------------------ admission

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tracked = self._track(request)
        self._done_loading(tracked)
        tracked.num_local = num_computed_tokens
        keys = tracked.keys.extend(request.all_token_ids, self.block_size)
        index = self.index
        num_blocks = 0
        for key in keys[num_computed_tokens // self.block_size :]:
            if key not in index:
                if not num_blocks and key in index.pending:
                    return None, False  # its file is being written: load it in a moment
                break
            if key in self._loading_keys:
                return None, False  # loading for another request: it will hit in memory
            num_blocks += 1
        return num_blocks * self.block_size, num_blocks > 0

    def update_state_after_alloc(
        self, request: Request, blocks: BlockList, num_external_tokens: int
    ) -> None:
        if not num_external_tokens:
            return
        tracked = self._tracked[request.request_id]
        block_ids = blocks.get_block_ids()
        first = tracked.num_local // self.block_size
        count = num_external_tokens // self.block_size
        keys = tracked.keys.keys[first : first + count]
        self._loads[request.request_id] = list(
            zip(block_ids[first : first + count], keys, strict=True)
        )
        self.index.pin(keys)
        tracked.loading = keys
        tracked.in_flight = True
        for key in keys:
            self._loading_keys[key] = self._loading_keys.get(key, 0) + 1

    def _done_loading(self, tracked: _Tracked) -> None:
        """The request's loaded blocks are in memory now (or it gave them back)."""
        for key in tracked.loading:
            count = self._loading_keys.get(key, 0) - 1
            if count > 0:
                self._loading_keys[key] = count
            else:
                self._loading_keys.pop(key, None)
        tracked.loading = []

    # ------------------------------------------------------------------ each step

    def build_connector_meta(self, scheduler_output: Any) -> OffloadMeta:
        tracked_all = self._tracked
        for new in scheduler_output.scheduled_new_reqs:
            tracked = tracked_all.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids)
                tracked.num_checked = 0
                self._done_loading(tracked)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for i, req_id in enumerate(cached.req_ids):
            tracked = tracked_all.get(req_id)
            new_blocks = cached.new_block_ids[i]
            if tracked is None:
                continue
            if req_id in resumed:
                tracked.block_ids = list(new_blocks or ())
                tracked.num_checked = 0
                self._done_loading(tracked)
            elif new_blocks:
                tracked.block_ids.extend(new_blocks)
        saves: list[tuple[int, str]] = []
        deletes = self._deletes
        block_size = self.block_size
        index = self.index
        for req_id in scheduler_output.num_scheduled_tokens:
            tracked = tracked_all.get(req_id)
            if tracked is None:
                continue
            request = tracked.request
            # Full blocks of verified tokens once this step ran (drafts excluded).
            num_full = min(request.num_computed_tokens, request.num_tokens) // block_size
            if num_full <= tracked.num_checked:
                continue
            keys = tracked.keys.extend(request.all_token_ids, block_size)
            block_ids = tracked.block_ids
            for i in range(tracked.num_checked, min(num_full, len(keys), len(block_ids))):
                key = keys[i]
                if index.known(key):
                    continue
                ok, evicted = index.reserve(key, self._file_bytes)
                deletes.extend(evicted)
                if ok:
                    saves.append((block_ids[i], key))
            tracked.num_checked = num_full
        meta = OffloadMeta(self._loads, saves, deletes)
        self._loads = {}
        self._deletes = []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        feedback = output.kv_connector_worker_meta
        index = self.index
        if isinstance(feedback, OffloadFeedback):
            for key in feedback.saved:
                index.commit(key)
            for key in feedback.failed:
                index.discard(key)
            for key in feedback.bad:
                index.discard(key)
            if feedback.disk_full:
                index.shrink_to_fit()
        for req_id in output.finished_recving:
            tracked = self._tracked.get(req_id)
            if tracked is not None and tracked.in_flight:
                tracked.in_flight = False
                index.unpin(tracked.loading)
            orphan = self._orphan_loads.pop(req_id, None)
            if orphan is not None:
                index.unpin(orphan)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is not None:
            if tracked.in_flight:
                # The worker still reads those files: unpinned when its load ends (the
                # scheduler holds the request's blocks until then).
                self._orphan_loads[request.request_id] = tracked.loading
            self._done_loading(tracked)
        return False, None

    def take_stats(self) -> KVTransferStats:
        stats = self._stats
        stats.tier_bytes = self.index.used_bytes
        self._stats = KVTransferStats()
        return stats

    def shutdown(self) -> None:
        self.index.close()
