"""The disk tier's pieces without a model: block keys, the file check, the index."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tokenloom.kv_transfer.base import KVCacheSpec
from tokenloom.kv_transfer.block_file import HEADER_BYTES, block_path, check, file_bytes, header
from tokenloom.kv_transfer.disk_tier import MANIFEST, DiskTierIndex
from tokenloom.kv_transfer.keys import BlockKeys, chain_root, prefix_digest
from tokenloom.lora_request import LoRARequest

SPEC = KVCacheSpec("11" * 16, "test model", block_size=4, num_layers=2, layer_bytes=8)
OTHER = KVCacheSpec("22" * 16, "another model", block_size=4, num_layers=2, layer_bytes=8)


def keys_of(tokens: list[int], spec: KVCacheSpec = SPEC, lora: LoRARequest | None = None):
    return list(BlockKeys(chain_root(spec.fingerprint, lora)).extend(tokens, spec.block_size))


def test_keys_are_a_salted_chain() -> None:
    tokens = list(range(10))
    keys = keys_of(tokens)
    assert len(keys) == 2 and all(len(k) == 32 for k in keys)
    assert keys == keys_of(tokens)  # the same in every process
    # A block's key covers its whole prefix, not just its own tokens.
    assert keys_of([9, 9, 9, 9, 4, 5, 6, 7])[1] != keys[1]
    assert keys_of(tokens + [10, 11])[:2] == keys
    assert keys_of(tokens, OTHER)[0] != keys[0]
    adapter = LoRARequest("sql", 1, "/adapters/sql")
    assert keys_of(tokens, lora=adapter)[0] != keys[0]
    # The adapter's id is not part of it: ids are only stable within a run.
    assert keys_of(tokens, lora=LoRARequest("sql", 7, "/adapters/sql")) == keys_of(
        tokens, lora=adapter
    )
    grown = BlockKeys(chain_root(SPEC.fingerprint))
    grown.extend(tokens[:5], 4)
    assert grown.extend(tokens, 4) == keys
    assert prefix_digest(SPEC.fingerprint, tokens) != prefix_digest(SPEC.fingerprint, tokens[:9])


def test_file_check_names_what_is_wrong() -> None:
    key = keys_of([1, 2, 3, 4])[0]
    payload = bytes(range(32))
    good = header(SPEC, key, payload) + payload

    def reason(data: bytes, spec: KVCacheSpec = SPEC, want: str = key) -> str | None:
        view = memoryview(data)
        payload = view[HEADER_BYTES:]
        # The payload in two parts, as a block's layer slabs are read.
        parts = [payload[: len(payload) // 2], payload[len(payload) // 2 :]]
        return check(spec, want, bytes(view[:HEADER_BYTES]), parts, len(data))

    assert reason(good) is None
    assert reason(good[:-1]) == "truncated"
    assert reason(good[:10]) == "truncated"
    assert reason(good + b"x") == "corrupt"
    flipped = bytearray(good)
    flipped[-1] ^= 1
    assert reason(bytes(flipped)) == "corrupt"
    assert reason(good, OTHER) == "foreign"
    assert reason(good, want=keys_of([5, 6, 7, 8])[0]) == "corrupt"
    assert reason(b"JUNK" + good[4:]) == "corrupt"
    older = bytearray(good)
    older[4] = 1  # the version: a file of the earlier CRC-32 format
    assert reason(bytes(older)) == "foreign"


def put(index: DiskTierIndex, key: str) -> list[str]:
    ok, evicted = index.reserve(key, 100)
    assert ok
    index.commit(key)
    path = block_path(index.root, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * 100)
    return evicted


def test_index_keeps_the_budget_evicting_least_recently_used(tmp_path: Path) -> None:
    index = DiskTierIndex(tmp_path, SPEC, capacity_bytes=300)
    keys = [f"{i:032x}" for i in range(5)]
    for key in keys[:3]:
        assert put(index, key) == []
    index.pin([keys[0]])  # a load reads it: most recently used, and not evictable
    assert put(index, keys[3]) == [keys[1]]
    assert index.used_bytes == 300
    index.unpin([keys[0]])
    assert put(index, keys[4]) == [keys[2]]
    assert list(index.stored) == [keys[0], keys[3], keys[4]]
    # Everything pinned: a save is refused rather than evicting a block being read.
    index.pin(keys)
    ok, evicted = index.reserve("f" * 32, 100)
    assert not ok and evicted == []
    # A pending save counts against the budget but is neither served nor evicted.
    index.unpin(keys)
    ok, evicted = index.reserve("e" * 32, 100)
    assert ok and evicted == [keys[0]]
    assert "e" * 32 not in index and index.known("e" * 32)
    index.discard("e" * 32)
    assert not index.known("e" * 32) and index.used_bytes == 200
    index.close()


def test_index_survives_a_restart_in_lru_order(tmp_path: Path) -> None:
    index = DiskTierIndex(tmp_path, SPEC, capacity_bytes=10_000)
    keys = [f"{i:032x}" for i in range(3)]
    for key in keys:
        put(index, key)
    index.close()
    now = time.time()
    for age, key in zip((30, 10, 20), keys, strict=True):  # key 1 used last
        os.utime(block_path(tmp_path, key), (now - age, now - age))
    (tmp_path / "tmp" / "half-written").write_bytes(b"x")
    again = DiskTierIndex(tmp_path, SPEC, capacity_bytes=10_000)
    assert list(again.stored) == [keys[0], keys[2], keys[1]]
    assert again.used_bytes == 300 and again.num_foreign_files == 0
    assert not (tmp_path / "tmp" / "half-written").exists()
    again.close()
    # A smaller budget at start evicts the least recently used at once.
    small = DiskTierIndex(tmp_path, SPEC, capacity_bytes=200)
    assert list(small.stored) == [keys[2], keys[1]]
    assert not block_path(tmp_path, keys[0]).exists()
    small.close()


def test_a_tier_written_for_another_model_is_removed(tmp_path: Path) -> None:
    index = DiskTierIndex(tmp_path, OTHER, capacity_bytes=10_000)
    put(index, "a" * 32)
    put(index, "b" * 32)
    index.close()
    (tmp_path / "notes.txt").write_text("mine")
    ours = DiskTierIndex(tmp_path, SPEC, capacity_bytes=10_000)
    assert ours.num_foreign_files == 2 and not ours.stored
    assert not block_path(tmp_path, "a" * 32).exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert json.loads((tmp_path / MANIFEST).read_text())["fingerprint"] == SPEC.fingerprint
    ours.close()


def test_one_engine_per_directory(tmp_path: Path) -> None:
    index = DiskTierIndex(tmp_path, SPEC, capacity_bytes=1000)
    with pytest.raises(ValueError, match="in use by another tokenloom engine"):
        DiskTierIndex(tmp_path, SPEC, capacity_bytes=1000)
    index.close()
    DiskTierIndex(tmp_path, SPEC, capacity_bytes=1000).close()


def test_file_size() -> None:
    assert file_bytes(SPEC) == HEADER_BYTES + 2 * 2 * 8
