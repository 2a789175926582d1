"""The scheduler's view of the encoder cache: which images' encoder outputs the runner holds.

The runner keeps each encoded item's output (one row per placeholder token)
under its ``identifier`` until the scheduler says to drop it; this manager
decides what it holds, in units of encoder tokens (``cache_size`` rows).

- An entry is *referenced* by the requests that still need it: those whose
  prompt has not yet been computed past the item. Requests showing the same
  image share one entry, so it is encoded once.
- When the last reference goes (``free_encoder_input``, ``free``), the entry
  stays: a later request with the same image reuses it
  (``check_and_update_cache``). Unreferenced entries are evicted, oldest
  first, only when a new item needs their room (``can_allocate``); evicted
  identifiers are reported once by ``get_freed_mm_hashes`` (the scheduler
  sends them to the runner as ``SchedulerOutput.free_encoder_mm_hashes``).

With ``share=False`` (the encoder cache disabled) nothing is reused: a request
finds only entries it allocated itself, and an entry goes (and is reported)
as soon as no request references it. Two requests with the same image then
each encode it, into the same runner entry; it is dropped after the last one.

Pure Python, no torch: tests drive it with requests only.
"""

from __future__ import annotations

from collections import OrderedDict

from tokenloom.request import Request


class EncoderCacheManager:
    """Encoder-output slots keyed by item identifier, shared between requests."""

    def __init__(self, cache_size: int, share: bool = True) -> None:
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        self.cache_size = cache_size
        self.share = share
        # Rows held by no entry, and rows held by no entry or by unreferenced ones.
        self.num_free_slots = cache_size
        self.num_freeable_slots = cache_size
        # identifier -> ids of the requests referencing it (empty: unreferenced).
        self.cached: dict[str, set[str]] = {}
        # identifier -> rows it holds, for every entry (share=False: all its allocations).
        self._sizes: dict[str, int] = {}
        # share=False: (identifier, request id) -> rows of that request's allocation.
        self._own: dict[tuple[str, str], int] = {}
        # Unreferenced entries, least recently released first: evicted in this order.
        self._unreferenced: OrderedDict[str, int] = OrderedDict()
        self._freed: list[str] = []

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        """True if item ``input_id`` of ``request`` is held (the request now references
        it, so it stays until released); False if it must be encoded."""
        identifier = _identifier(request, input_id)
        refs = self.cached.get(identifier)
        if refs is None:
            return False
        if not self.share:
            return request.request_id in refs
        if not refs:
            self.num_freeable_slots -= self._unreferenced.pop(identifier)
        refs.add(request.request_id)
        return True

    def can_allocate(
        self,
        request: Request,
        input_id: int,
        encoder_compute_budget: int,
        num_tokens_to_schedule: int,
    ) -> bool:
        """Whether item ``input_id`` can be encoded this step: it fits what is left of
        ``encoder_compute_budget``, and the cache has room for it on top of the
        ``num_tokens_to_schedule`` rows this request already claims this step,
        evicting unreferenced entries (oldest first) if it must."""
        num_tokens = request.get_num_encoder_tokens(input_id)
        if num_tokens > encoder_compute_budget:
            return False
        needed = num_tokens + num_tokens_to_schedule
        if needed <= self.num_free_slots:
            return True
        if needed > self.num_freeable_slots:
            return False
        while self.num_free_slots < needed:
            identifier, size = self._unreferenced.popitem(last=False)
            del self.cached[identifier]
            del self._sizes[identifier]
            self._freed.append(identifier)
            self.num_free_slots += size
        return True

    def allocate(self, request: Request, input_id: int) -> None:
        """Claim room for item ``input_id``, encoded by the runner this step (call
        after ``can_allocate`` said yes)."""
        identifier = _identifier(request, input_id)
        num_tokens = request.get_num_encoder_tokens(input_id)
        refs = self.cached.setdefault(identifier, set())
        if self.share and identifier in self._sizes:
            raise ValueError(f"encoder input {identifier!r} is already cached")
        if request.request_id in refs:
            raise ValueError(f"request {request.request_id} already holds {identifier!r}")
        refs.add(request.request_id)
        self._sizes[identifier] = self._sizes.get(identifier, 0) + num_tokens
        if not self.share:
            self._own[identifier, request.request_id] = num_tokens
        self.num_free_slots -= num_tokens
        self.num_freeable_slots -= num_tokens

    def get_cached_input_ids(self, request: Request) -> set[int]:
        """Indices of ``request``'s items it references."""
        features = request.mm_features or ()
        request_id = request.request_id
        return {
            i
            for i, feature in enumerate(features)
            if request_id in self.cached.get(feature.identifier, ())
        }

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        """``request`` no longer needs item ``input_id`` (its prompt is computed past it)."""
        identifier = _identifier(request, input_id)
        refs = self.cached.get(identifier)
        if refs is None or request.request_id not in refs:
            return
        refs.discard(request.request_id)
        if not self.share:
            size = self._own.pop((identifier, request.request_id))
            self._sizes[identifier] -= size
            self.num_free_slots += size
            self.num_freeable_slots += size
            if not refs:
                del self.cached[identifier]
                del self._sizes[identifier]
                self._freed.append(identifier)
            return
        if not refs:
            size = self._sizes[identifier]
            self._unreferenced[identifier] = size
            self.num_freeable_slots += size

    def free(self, request: Request) -> None:
        """Release every item ``request`` references (it finished or was preempted)."""
        for input_id in self.get_cached_input_ids(request):
            self.free_encoder_input(request, input_id)

    def discard(self, identifier: str) -> None:
        """Undo an allocation the runner never computed: the request that was to
        encode ``identifier`` was preempted in the same step (and released it).

        Shared, the entry goes with any references taken on it this step (whoever
        needs it later encodes it again). Unshared, the preempted request's own
        allocation went with its release; if that dropped the entry, the drop is
        not reported (the runner never held it)."""
        if not self.share:
            if identifier not in self.cached and identifier in self._freed:
                del self._freed[len(self._freed) - 1 - self._freed[::-1].index(identifier)]
            return
        refs = self.cached.pop(identifier, None)
        if refs is None:
            return
        size = self._sizes.pop(identifier)
        if refs:
            self.num_freeable_slots += size
        else:
            del self._unreferenced[identifier]
        self.num_free_slots += size

    def get_freed_mm_hashes(self) -> list[str]:
        """Identifiers dropped since the previous call (the runner drops their outputs)."""
        freed, self._freed = self._freed, []
        return freed

    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` if the slot counts disagree with the entries."""
        held = sum(self._sizes.values())
        unreferenced = sum(self._unreferenced.values())
        if self.num_free_slots != self.cache_size - held:
            raise RuntimeError(
                f"encoder cache: {self.num_free_slots} free slots, but entries hold {held} "
                f"of {self.cache_size}"
            )
        if self.num_freeable_slots != self.num_free_slots + unreferenced:
            raise RuntimeError("encoder cache: freeable slots disagree with unreferenced entries")
        for identifier, refs in self.cached.items():
            if bool(refs) == (identifier in self._unreferenced):
                raise RuntimeError(f"encoder cache: entry {identifier!r} referenced and free")

    @property
    def num_referenced(self) -> int:
        """Entries some request still needs (0 once every request is gone)."""
        return sum(1 for refs in self.cached.values() if refs)


def _identifier(request: Request, input_id: int) -> str:
    assert request.mm_features is not None
    return request.mm_features[input_id].identifier
