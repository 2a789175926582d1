"""The encoder cache manager: shared entries, references, eviction of unreferenced ones."""

from __future__ import annotations

import pytest

from tests.core.utils import make_request
from tokenloom.core.encoder_cache_manager import EncoderCacheManager
from tokenloom.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from tokenloom.request import Request


def _request(req_id: str, *images: tuple[str, int]) -> Request:
    """A request showing ``images`` ((identifier, tokens) each), one after another."""
    features = []
    offset = 2
    for identifier, length in images:
        features.append(MultiModalFeatureSpec(identifier, PlaceholderRange(offset, length)))
        offset += length + 1
    return make_request(req_id, offset + 2, mm_features=features)


def test_an_entry_is_shared_and_kept_until_its_room_is_needed() -> None:
    cache = EncoderCacheManager(cache_size=10)
    a, b, c = _request("a", ("x", 6)), _request("b", ("x", 6)), _request("c", ("y", 6))
    assert not cache.check_and_update_cache(a, 0)
    assert cache.can_allocate(a, 0, encoder_compute_budget=10, num_tokens_to_schedule=0)
    cache.allocate(a, 0)
    assert cache.check_and_update_cache(b, 0)  # b shares a's entry: nothing to encode
    assert cache.get_cached_input_ids(a) == cache.get_cached_input_ids(b) == {0}
    cache.free(a)
    cache.free_encoder_input(b, 0)
    assert cache.num_referenced == 0 and cache.num_free_slots == 4
    assert cache.num_freeable_slots == 10
    # c's image needs x's room: x, unreferenced, is evicted and reported once.
    assert cache.can_allocate(c, 0, 10, 0)
    cache.allocate(c, 0)
    assert cache.get_freed_mm_hashes() == ["x"]
    assert cache.get_freed_mm_hashes() == []
    assert not cache.check_and_update_cache(a, 0)
    cache.free(c)
    cache.check_integrity()


def test_referenced_entries_are_never_evicted() -> None:
    cache = EncoderCacheManager(cache_size=10)
    a, b = _request("a", ("x", 6)), _request("b", ("y", 6))
    cache.allocate(a, 0)
    assert not cache.can_allocate(b, 0, 10, 0)
    assert cache.get_freed_mm_hashes() == []
    cache.free(a)
    assert cache.can_allocate(b, 0, 10, 0)


def test_budget_and_room_claimed_this_step_count() -> None:
    cache = EncoderCacheManager(cache_size=10)
    a = _request("a", ("x", 6), ("y", 4))
    assert not cache.can_allocate(a, 0, encoder_compute_budget=5, num_tokens_to_schedule=0)
    assert cache.can_allocate(a, 1, 10, num_tokens_to_schedule=6)
    assert not cache.can_allocate(a, 0, 10, num_tokens_to_schedule=6)


def test_eviction_takes_the_least_recently_released_entries() -> None:
    cache = EncoderCacheManager(cache_size=9)
    holders = [_request(name, (name, 3)) for name in "xyz"]
    for request in holders:
        cache.allocate(request, 0)
    for request in (holders[1], holders[0], holders[2]):  # y, then x, then z released
        cache.free(request)
    w = _request("w", ("w", 5))
    assert cache.can_allocate(w, 0, 9, 0)
    cache.allocate(w, 0)
    assert cache.get_freed_mm_hashes() == ["y", "x"]
    assert set(cache.cached) == {"z", "w"}


def test_without_sharing_each_request_encodes_its_own() -> None:
    cache = EncoderCacheManager(cache_size=12, share=False)
    a, b = _request("a", ("x", 6)), _request("b", ("x", 6))
    cache.allocate(a, 0)
    assert cache.check_and_update_cache(a, 0)
    assert not cache.check_and_update_cache(b, 0)
    cache.allocate(b, 0)  # the same identifier: the runner overwrites one entry
    assert cache.num_free_slots == 0
    cache.free(a)
    assert cache.get_freed_mm_hashes() == []  # b still needs it
    cache.free(b)
    assert cache.get_freed_mm_hashes() == ["x"]  # dropped at once, never kept
    assert cache.num_free_slots == cache.num_freeable_slots == 12
    cache.check_integrity()


def test_allocating_a_held_entry_twice_is_refused() -> None:
    cache = EncoderCacheManager(cache_size=12)
    a = _request("a", ("x", 6))
    cache.allocate(a, 0)
    with pytest.raises(ValueError, match="already"):
        cache.allocate(_request("b", ("x", 6)), 0)
    with pytest.raises(ValueError, match="cache_size"):
        EncoderCacheManager(-1)
