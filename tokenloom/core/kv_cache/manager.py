"""Paged KV cache manager with prefix caching: the scheduler's view of KV memory.

The scheduler asks ``get_computed_blocks`` for a prefix hit, then
``allocate_slots`` for the tokens it wants to run; ``None`` means "not enough
free blocks, nothing changed" and the scheduler preempts. Only full blocks are
cached, keyed by exact chained hashes (:mod:`tokenloom.core.kv_cache.hashing`).

Beyond the contract: ``num_usable_blocks``, ``next_allocation_at()``,
``create_empty_block_list()``, ``check_integrity()`` (for tests and idle checks)
and ``block_pool`` (read-only inspection); for KV connectors, ``get_blocks()``,
``allocate_slots(..., delay_cache_blocks=True)`` and ``drop_cached_blocks()``.

A decoding request gives ``allocate_slots`` work (a new block, or a block
filled and cached) only once a block, so a call with nothing to do is one dict
lookup and a few comparisons returning the shared :data:`EMPTY_BLOCKS`, and
``next_allocation_at(request_id)`` says where the work starts again so that
the scheduler can skip such calls altogether.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from tokenloom.core.kv_cache.block import EMPTY_BLOCKS, KVCacheBlock, KVCacheBlocks
from tokenloom.core.kv_cache.block_pool import BlockPool
from tokenloom.core.kv_cache.events import BlockStored, KVCacheEvent
from tokenloom.core.kv_cache.hashing import BlockHash, extend_block_hashes
from tokenloom.request import Request

_NEVER = sys.maxsize


class _RequestBlocks:
    """Per-request allocation state, kept flat so the no-op path reads few attributes.

    ``capacity`` is ``len(blocks) * block_size``; ``next_cache_end`` is the token
    count at which another block becomes full and must be cached (``_NEVER``
    without prefix caching).
    """

    __slots__ = ("blocks", "num_cached", "capacity", "next_cache_end")

    def __init__(self) -> None:
        self.blocks: list[KVCacheBlock] = []
        self.num_cached = 0
        self.capacity = 0
        self.next_cache_end = 0


class KVCacheManager:
    """Allocates blocks to requests and shares cached full-block prefixes between them."""

    def __init__(
        self, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = True
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.num_blocks = num_blocks
        self._requests: dict[str, _RequestBlocks] = {}
        self._next_allocation_at: dict[str, int] = {}
        # next_allocation_at(request_id) -> int, for a request holding blocks
        # (KeyError for one holding none): the token count from which
        # allocate_slots has work to do for it. While num_computed_tokens +
        # num_new_tokens stays below it, a call without lookahead tokens or
        # prefix-hit blocks adds no block, caches none and returns EMPTY_BLOCKS,
        # so a scheduler may skip the call; at the bound the call adds or fills a
        # block. It is the dict's own lookup rather than a def because the
        # scheduler asks it for every running request every step, where a
        # Python-level call shows in schedule()'s time.
        self.next_allocation_at: Callable[[str], int] = self._next_allocation_at.__getitem__

    # ------------------------------------------------------------------ queries

    @property
    def usage(self) -> float:
        """Share of usable blocks (the null block excluded) held by requests."""
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        """Usable blocks with ref_cnt 0, including cached ones (they are evictable)."""
        return len(self.block_pool.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can ever get: all but the null block."""
        return self.num_blocks - 1

    # ------------------------------------------------------------------ events

    def enable_events(self) -> None:
        """Record KV cache events from now on (see :mod:`tokenloom.core.kv_cache.events`)."""
        if self.block_pool.events is None:
            self.block_pool.events = []

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call (none while recording is off)."""
        pool = self.block_pool
        events = pool.events
        if not events:
            return []
        pool.events = []
        return events

    def create_empty_block_list(self) -> KVCacheBlocks:
        return EMPTY_BLOCKS

    def get_block_ids(self, request_id: str) -> list[int]:
        state = self._requests.get(request_id)
        if state is None:
            return []
        return [block.block_id for block in state.blocks]

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """Every block the request holds, in order (empty when it holds none)."""
        state = self._requests.get(request_id)
        return KVCacheBlocks(state.blocks) if state is not None else EMPTY_BLOCKS

    def get_num_common_prefix_blocks(self, request_id: str) -> int:
        """Leading blocks of ``request_id`` held by every request that holds blocks."""
        state = self._requests.get(request_id)
        if state is None:
            return 0
        num_holders = len(self._requests)
        count = 0
        for block in state.blocks:
            if block.ref_cnt != num_holders:
                break
            count += 1
        return count

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of ``request``, in full blocks, without side effects.

        At most ``num_tokens - 1`` tokens can hit: the last token is always
        recomputed to produce logits, so the hit is floored to the full blocks
        lying within the first ``num_tokens - 1`` tokens. Only the request's
        block hash list is extended (hashes are pure functions of its tokens).
        """
        if not self.enable_caching:
            return EMPTY_BLOCKS, 0
        cached = self.block_pool.cached
        hashes = extend_block_hashes(request, self.block_size, cached)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for i in range(min(max_blocks, len(hashes))):
            block = cached.get(hashes[i])
            if block is None:
                break
            hits.append(block)
        if not hits:
            return EMPTY_BLOCKS, 0
        return KVCacheBlocks(hits), len(hits) * self.block_size

    # -------------------------------------------------------------- allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` (+ lookahead) after the computed tokens.

        ``new_computed_blocks``/``num_new_computed_tokens`` are a prefix hit from
        :meth:`get_computed_blocks` for a request holding no blocks yet. Returns
        the newly allocated blocks (the shared empty instance when none were
        needed), or None when free blocks do not suffice, in which case nothing
        changed. Full blocks up to ``num_computed + num_new_tokens`` are cached
        at once, so later lookups can hit them; with ``delay_cache_blocks`` (a
        first allocation whose KV a connector loads) they are not, until
        :meth:`cache_blocks` says they hold their KV.
        """
        state = self._requests.get(request.request_id)
        if state is None or not (
            new_computed_blocks is None or new_computed_blocks is EMPTY_BLOCKS
        ):
            return self._allocate_with_prefix(
                request,
                state,
                num_new_tokens,
                num_new_computed_tokens,
                new_computed_blocks,
                num_lookahead_tokens,
                delay_cache_blocks,
            )
        # Hot path: a running request whose tokens fit its blocks and fill no block.
        end = request.num_computed_tokens + num_new_tokens
        if end < state.next_cache_end and end + num_lookahead_tokens <= state.capacity:
            if num_new_tokens < 0 or num_lookahead_tokens < 0 or num_new_computed_tokens:
                self._validate(num_new_tokens, num_new_computed_tokens, 0, num_lookahead_tokens)
            return EMPTY_BLOCKS
        if num_new_tokens < 0 or num_lookahead_tokens < 0 or num_new_computed_tokens:
            self._validate(num_new_tokens, num_new_computed_tokens, 0, num_lookahead_tokens)
        return self._extend(request, state, end, end + num_lookahead_tokens)

    def _validate(
        self,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        num_computed_blocks: int,
        num_lookahead_tokens: int,
    ) -> None:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0, got {num_lookahead_tokens}")
        if num_new_computed_tokens != num_computed_blocks * self.block_size:
            raise ValueError(
                f"num_new_computed_tokens ({num_new_computed_tokens}) must equal "
                f"block_size * len(new_computed_blocks) ({num_computed_blocks * self.block_size})"
            )

    def _extend(
        self, request: Request, state: _RequestBlocks, end: int, num_slots: int
    ) -> KVCacheBlocks | None:
        """Grow a running request to ``num_slots`` slots and cache blocks full at ``end``."""
        block_size = self.block_size
        if num_slots > self.max_model_len:
            num_slots = self.max_model_len
        num_new_blocks = -(-num_slots // block_size) - len(state.blocks)
        new = EMPTY_BLOCKS
        if num_new_blocks > 0:
            pool = self.block_pool
            if num_new_blocks > len(pool.free_queue):
                return None
            blocks = pool.get_new_blocks(num_new_blocks)
            state.blocks.extend(blocks)
            state.capacity = len(state.blocks) * block_size
            new = KVCacheBlocks(blocks)
        if end >= state.next_cache_end:
            num_tokens = len(request.all_token_ids)
            self._cache_full_blocks(request, state, end if end < num_tokens else num_tokens)
        # _publish_next_allocation, inlined: this runs for each decoding request once a block.
        capacity_end = state.capacity + 1
        next_cache_end = state.next_cache_end
        self._next_allocation_at[request.request_id] = (
            next_cache_end if next_cache_end < capacity_end else capacity_end
        )
        return new

    def _allocate_with_prefix(
        self,
        request: Request,
        state: _RequestBlocks | None,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_lookahead_tokens: int,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """First allocation of a new or resumed request, possibly on top of a prefix hit."""
        block_size = self.block_size
        computed = new_computed_blocks.blocks if new_computed_blocks is not None else ()
        self._validate(num_new_tokens, num_new_computed_tokens, len(computed), num_lookahead_tokens)
        num_held = len(state.blocks) if state is not None else 0
        if computed:
            if num_held * block_size != request.num_computed_tokens:
                raise ValueError(
                    "new_computed_blocks must directly follow the request's computed tokens"
                )
            hashes = request.block_hashes
            for i, block in enumerate(computed, num_held):
                if block.block_hash is None or i >= len(hashes) or block.block_hash != hashes[i]:
                    raise ValueError(
                        f"new_computed_blocks of request {request.request_id!r} are not a "
                        "current prefix hit (call get_computed_blocks right before "
                        "allocate_slots)"
                    )

        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_slots = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_new_blocks = max(-(-num_slots // block_size) - num_held - len(computed), 0)

        pool = self.block_pool
        # Touching a free cached block takes it out of the free queue too.
        num_touched_free = 0
        for block in computed:
            if block.ref_cnt == 0:
                num_touched_free += 1
        if num_new_blocks + num_touched_free > len(pool.free_queue):
            return None

        if state is None:
            if not computed and num_new_blocks == 0:
                return EMPTY_BLOCKS
            state = _RequestBlocks()
            state.next_cache_end = block_size if self.enable_caching else _NEVER
            self._requests[request.request_id] = state
        if computed:
            pool.touch(computed)
            state.blocks.extend(computed)
        new_blocks: list[KVCacheBlock] = []
        if num_new_blocks:
            new_blocks = pool.get_new_blocks(num_new_blocks)
            state.blocks.extend(new_blocks)
        state.capacity = len(state.blocks) * block_size

        if self.enable_caching and not delay_cache_blocks:
            self._cache_full_blocks(
                request, state, min(num_computed + num_new_tokens, request.num_tokens)
            )
        self._publish_next_allocation(request.request_id, state)
        return KVCacheBlocks(new_blocks) if new_blocks else EMPTY_BLOCKS

    def _publish_next_allocation(self, request_id: str, state: _RequestBlocks) -> None:
        """Refresh ``next_allocation_at(request_id)`` after its blocks or cached count changed."""
        capacity_end = state.capacity + 1
        next_cache_end = state.next_cache_end
        self._next_allocation_at[request_id] = (
            next_cache_end if next_cache_end < capacity_end else capacity_end
        )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's full blocks among its first ``num_computed_tokens`` tokens.

        Idempotent and incremental: blocks already cached for the request are skipped.
        """
        if not self.enable_caching:
            return
        state = self._requests.get(request.request_id)
        if state is None:
            return
        self._cache_full_blocks(request, state, min(num_computed_tokens, request.num_tokens))
        self._publish_next_allocation(request.request_id, state)

    def _cache_full_blocks(self, request: Request, state: _RequestBlocks, num_tokens: int) -> None:
        block_size = self.block_size
        num_full = min(num_tokens // block_size, len(state.blocks))
        if num_full <= state.num_cached:
            return
        pool = self.block_pool
        hashes = extend_block_hashes(request, block_size, pool.cached)
        blocks = state.blocks
        stored: list[int] | None = None if pool.events is None else []
        for i in range(state.num_cached, num_full):
            block = blocks[i]
            # A prefix-hit block already carries its hash; a block whose prefix
            # another block already caches stays unregistered (a duplicate).
            if block.block_hash is None:
                if pool.cache_block(block, hashes[i]) and stored is not None:
                    stored.append(i)
        if stored:
            self._record_stored(request, hashes, stored)
        state.num_cached = num_full
        state.next_cache_end = (num_full + 1) * block_size

    def _record_stored(self, request: Request, hashes: list[BlockHash], indices: list[int]) -> None:
        """One ``BlockStored`` per run of consecutive newly cached blocks of ``request``."""
        events = self.block_pool.events
        assert events is not None
        size = self.block_size
        tokens = request.all_token_ids
        lora_id = request.lora_int_id or None
        start = 0
        for k in range(1, len(indices) + 1):
            if k < len(indices) and indices[k] == indices[k - 1] + 1:
                continue
            first, last = indices[start], indices[k - 1]
            events.append(
                BlockStored(
                    block_hashes=[h.digest for h in hashes[first : last + 1]],
                    parent_block_hash=hashes[first - 1].digest if first else None,
                    token_ids=list(tokens[first * size : (last + 1) * size]),
                    block_size=size,
                    lora_id=lora_id,
                )
            )
            start = k

    def drop_cached_blocks(self, block_ids: set[int]) -> None:
        """Take these blocks out of the prefix cache (their KV failed to load): no
        later lookup hits them; whoever holds them keeps them."""
        self.block_pool.uncache([self.block_pool.blocks[i] for i in sorted(block_ids)])

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its last blocks are evicted first."""
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            del self._next_allocation_at[request.request_id]
            self.block_pool.free_blocks(reversed(state.blocks))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; False (nothing changed) while any usable block is in use."""
        return self.block_pool.reset_prefix_cache()

    # ---------------------------------------------------------------- checking

    def check_integrity(self) -> None:
        """Verify the bookkeeping invariants; raise RuntimeError naming the first violation."""
        pool = self.block_pool
        null = pool.null_block
        if null.ref_cnt != 0 or null.block_hash is not None or null.prev_free is not None:
            raise RuntimeError("null block 0 was handed out, cached or queued")

        seen: set[int] = set()
        for block in pool.free_queue:
            if block.block_id in seen:
                raise RuntimeError(f"block {block.block_id} is in the free queue twice")
            seen.add(block.block_id)
            if block.ref_cnt != 0:
                raise RuntimeError(f"queued block {block.block_id} has ref_cnt {block.ref_cnt}")
            if block is null:
                raise RuntimeError("null block 0 is in the free queue")
        if len(seen) != len(pool.free_queue):
            raise RuntimeError(
                f"free queue walks {len(seen)} blocks but counts {len(pool.free_queue)}"
            )

        expected_refs = [0] * pool.num_blocks
        for request_id, state in self._requests.items():
            if not state.blocks:
                raise RuntimeError(f"request {request_id} holds an empty block list")
            ids = [block.block_id for block in state.blocks]
            if len(set(ids)) != len(ids):
                raise RuntimeError(f"request {request_id} holds a block twice: {ids}")
            for block in state.blocks:
                if block is null or pool.blocks[block.block_id] is not block:
                    raise RuntimeError(f"request {request_id} holds a foreign block {block}")
                expected_refs[block.block_id] += 1
            if state.capacity != len(state.blocks) * self.block_size:
                raise RuntimeError(f"request {request_id} capacity out of date")
            if state.num_cached > len(state.blocks):
                raise RuntimeError(f"request {request_id} caches more blocks than it holds")
            bound = min(state.next_cache_end, state.capacity + 1)
            if self._next_allocation_at.get(request_id) != bound:
                raise RuntimeError(f"request {request_id}: next_allocation_at out of date")
        if self._next_allocation_at.keys() != self._requests.keys():
            raise RuntimeError("next_allocation_at knows requests that hold no blocks")

        num_zero = 0
        for block in pool.blocks[1:]:
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} has negative ref_cnt {block.ref_cnt}")
            if block.ref_cnt != expected_refs[block.block_id]:
                raise RuntimeError(
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                    f"{expected_refs[block.block_id]} requests hold it"
                )
            if block.ref_cnt == 0:
                num_zero += 1
                if block.block_id not in seen:
                    raise RuntimeError(f"free block {block.block_id} is not in the free queue")
            if block.block_hash is not None and pool.cached.get(block.block_hash) is not block:
                raise RuntimeError(f"block {block.block_id} carries a hash the cache does not map")
        if num_zero != len(pool.free_queue):
            raise RuntimeError(
                f"free queue holds {len(pool.free_queue)} blocks, {num_zero} have ref_cnt 0"
            )

        for block_hash, block in pool.cached.items():
            if block.block_hash is not block_hash:
                raise RuntimeError(
                    f"cache entry {block_hash} maps block {block.block_id} "
                    "which carries another hash"
                )
