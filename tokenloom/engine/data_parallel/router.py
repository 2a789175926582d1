"""Which engine core serves a request, and how loaded each core is.

``prefix`` routing keeps, per core, the block digests its KV cache events
reported stored (minus those removed). A request goes to the core holding the
longest prefix of its prompt, among the cores whose load (unfinished requests)
is within ``load_margin`` of the least loaded one; ties go to the less loaded
core, then round robin. A prompt no core holds half of counts as new and goes
to the core holding the fewest blocks (as SGLang's cache-aware router sends
it to the smallest tree), so distinct prefixes spread over the cores instead
of following the momentary load. Events arrive a step late, so a routed prompt's blocks
count as held by its core at once, for ``pending_ttl_s`` or until confirmed:
requests sharing a prompt that arrive together land together.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from tokenloom.config import DPLoadBalanceConfig
from tokenloom.core.kv_cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from tokenloom.core.kv_cache.hashing import prompt_block_digests


class _PrefixIndex:
    """The block digests one core holds: confirmed by events, or expected (with an expiry)."""

    __slots__ = ("stored", "pending")

    def __init__(self) -> None:
        self.stored: set[int] = set()
        self.pending: dict[int, float] = {}

    def num_leading(self, digests: list[int], now: float) -> int:
        stored, pending = self.stored, self.pending
        count = 0
        for digest in digests:
            if digest not in stored and pending.get(digest, 0.0) <= now:
                break
            count += 1
        return count

    def size(self, now: float) -> int:
        """Blocks held: confirmed, plus expected ones not yet expired."""
        return len(self.stored) + sum(1 for until in self.pending.values() if until > now)

    def expect(self, digests: list[int], until: float, now: float) -> None:
        pending = self.pending
        if len(pending) > 4 * len(self.stored) + 1024:  # drop expired entries now and then
            self.pending = pending = {d: t for d, t in pending.items() if t > now}
        for digest in digests:
            if digest not in self.stored:
                pending[digest] = until


class Router:
    """Routes requests to ``num_engines`` cores and counts each core's unfinished requests."""

    def __init__(
        self,
        num_engines: int,
        config: DPLoadBalanceConfig,
        block_size: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_engines = num_engines
        self.config = config
        self.block_size = block_size
        self._clock = clock
        self.loads = [0] * num_engines
        self._owner: dict[str, int] = {}
        self._next = 0
        self._indexes = [_PrefixIndex() for _ in range(num_engines)]

    @property
    def uses_kv_events(self) -> bool:
        return self.config.policy == "prefix"

    def stored_blocks(self, engine: int) -> set[int]:
        """The block digests core ``engine``'s events reported cached (and not evicted)."""
        return self._indexes[engine].stored

    def owner(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def route(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        lora_int_id: int = 0,
        exclude: Collection[int] = (),
    ) -> int:
        """Pick a core for a new request (never one in ``exclude``) and count it there."""
        candidates = [i for i in range(self.num_engines) if i not in exclude]
        if not candidates:
            raise RuntimeError("no engine core left to route to")
        # Rotating the candidates makes every tie-break below round robin.
        start = self._next % len(candidates)
        candidates = candidates[start:] + candidates[:start]
        self._next += 1
        policy = self.config.policy
        if policy == "round_robin":
            engine = candidates[0]
        elif policy == "least_load":
            engine = min(candidates, key=self.loads.__getitem__)
        else:
            engine = self._route_by_prefix(candidates, prompt_token_ids, lora_int_id)
        self.loads[engine] += 1
        self._owner[request_id] = engine
        return engine

    def _route_by_prefix(self, candidates: list[int], token_ids: list[int], lora: int) -> int:
        # Only blocks before the last prompt token can hit (the last is always recomputed).
        hit_tokens = token_ids[: max(len(token_ids) - 1, 0)]
        digests = prompt_block_digests(hit_tokens, self.block_size, lora)
        loads = self.loads
        floor = min(loads[i] for i in candidates) + self.config.load_margin
        now = self._clock()
        eligible = [i for i in candidates if loads[i] <= floor]
        indexes = self._indexes
        hits = {i: indexes[i].num_leading(digests, now) for i in eligible}
        best = max(eligible, key=lambda i: (hits[i], -loads[i]))  # first of equals wins
        if 2 * hits[best] < len(digests):  # a new prefix: to the emptiest cache
            best = min(eligible, key=lambda i: (indexes[i].size(now), loads[i]))
        if digests:
            self._indexes[best].expect(digests, now + self.config.pending_ttl_s, now)
        return best

    def release(self, request_id: str) -> int | None:
        """The request finished or was aborted: its core's load drops. Returns that core."""
        engine = self._owner.pop(request_id, None)
        if engine is not None:
            self.loads[engine] -= 1
        return engine

    def apply_events(self, batch: KVEventBatch) -> None:
        """Update a core's digests from its published KV cache events."""
        rank = batch.data_parallel_rank
        if rank is None or not 0 <= rank < self.num_engines:
            return
        index = self._indexes[rank]
        for event in batch.events:
            if isinstance(event, BlockStored):
                index.stored.update(event.block_hashes)
                for digest in event.block_hashes:
                    index.pending.pop(digest, None)
            elif isinstance(event, BlockRemoved):
                index.stored.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                index.stored.clear()
                index.pending.clear()

    def release_engine(self, engine: int) -> list[str]:
        """Core ``engine`` died: release every request it owned and return their ids."""
        ids = [request_id for request_id, owner in self._owner.items() if owner == engine]
        for request_id in ids:
            self.release(request_id)
        return ids

    def forget_engine(self, engine: int) -> None:
        """A core restarted with an empty cache: drop what it was known to hold."""
        self._indexes[engine] = _PrefixIndex()
