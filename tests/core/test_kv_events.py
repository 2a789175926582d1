"""KV cache events recorded by the manager and pool, and digests a front end can recompute."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.core.test_kv_cache_manager import BS, decode, make_manager, make_request, schedule
from tokenloom.core.kv_cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from tokenloom.core.kv_cache.hashing import prompt_block_digests
from tokenloom.lora_request import LoRARequest
from tokenloom.request import Request
from tokenloom.sampling_params import SamplingParams


def test_nothing_is_recorded_unless_enabled() -> None:
    manager = make_manager()
    schedule(manager, make_request("a", list(range(9))))
    assert manager.block_pool.events is None
    assert manager.take_events() == []


def test_stored_events_carry_digests_the_front_end_computes() -> None:
    manager = make_manager()
    manager.enable_events()
    tokens = list(range(100, 110))  # two full blocks and a partial one
    request = make_request("a", tokens)
    schedule(manager, request)
    events = manager.take_events()
    assert events == [
        BlockStored(
            block_hashes=prompt_block_digests(tokens, BS),
            parent_block_hash=None,
            token_ids=tokens[: 2 * BS],
            block_size=BS,
            lora_id=None,
        )
    ]
    assert manager.take_events() == []
    # Decoding fills the third block: one more event, chained to the second block.
    for token in (7, 8):
        decode(manager, request, token)
    (stored,) = manager.take_events()
    assert isinstance(stored, BlockStored)
    full = tokens + [7, 8]
    assert stored.block_hashes == prompt_block_digests(full, BS)[2:]
    assert stored.parent_block_hash == prompt_block_digests(full, BS)[1]
    assert stored.token_ids == full[2 * BS : 3 * BS]


def test_a_prefix_hit_stores_only_the_new_blocks() -> None:
    manager = make_manager()
    manager.enable_events()
    shared = list(range(2 * BS))
    schedule(manager, make_request("a", shared + [1]))
    manager.take_events()
    schedule(manager, make_request("b", shared + [5, 6, 7, 8, 9]))
    (stored,) = manager.take_events()
    assert isinstance(stored, BlockStored)
    digests = prompt_block_digests(shared + [5, 6, 7, 8, 9], BS)
    assert stored.block_hashes == digests[2:]
    assert stored.parent_block_hash == digests[1]


def test_eviction_and_reset_are_reported() -> None:
    manager = make_manager(num_blocks=5)  # four usable blocks
    manager.enable_events()
    first = make_request("a", list(range(2 * BS)))
    schedule(manager, first)
    manager.free(first)
    first_digests = prompt_block_digests(list(range(2 * BS)), BS)
    manager.take_events()
    # Needs all four blocks: the two cached ones are evicted (one event for both).
    second = make_request("b", list(range(50, 50 + 4 * BS)))
    schedule(manager, second)
    events = manager.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert len(removed) == 1 and sorted(removed[0].block_hashes) == sorted(first_digests)
    manager.free(second)
    assert manager.reset_prefix_cache()
    assert manager.take_events() == [AllBlocksCleared()]


def test_lora_blocks_have_their_own_digests() -> None:
    manager = make_manager()
    manager.enable_events()
    tokens = list(range(BS))
    lora = LoRARequest("x", 3, "/nonexistent")
    request = Request("a", tokens + [0], SamplingParams(), lora_request=lora)
    schedule(manager, request)
    (stored,) = manager.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.lora_id == 3
    assert stored.block_hashes == prompt_block_digests(tokens, BS, lora_int_id=3)
    assert stored.block_hashes != prompt_block_digests(tokens, BS)


def test_batches_round_trip_through_msgpack() -> None:
    batch = KVEventBatch(
        ts=1.5,
        events=[BlockStored([1, 2], None, [0] * 8, 4, None), BlockRemoved([3]), AllBlocksCleared()],
        data_parallel_rank=1,
    )
    assert decode_batch(encode_batch(batch)) == batch


def test_digests_are_the_same_in_another_process() -> None:
    """Cores and the front end are separate processes (hash seeds differ)."""
    tokens = list(range(3 * BS))
    code = (
        "from tokenloom.core.kv_cache.hashing import prompt_block_digests as d;"
        f"print(d({tokens}, {BS}), d({tokens}, {BS}, 2))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout.strip()
    here = f"{prompt_block_digests(tokens, BS)} {prompt_block_digests(tokens, BS, 2)}"
    assert out == here
