"""KV cache events: which prefix blocks an engine core holds (vLLM's ``KVEventBatch``).

The block pool and manager record them only while recording is on (a list is
attached); the engine core sends each step's events as one ``KVEventBatch``.
A hash is a block's 64-bit chain digest
(:func:`tokenloom.core.kv_cache.hashing.prompt_block_digests` computes the same
numbers from token ids), so a router can tell how much of a prompt a core holds.
"""

from __future__ import annotations

import msgspec


class BlockStored(msgspec.Struct, tag=True):
    """Full blocks newly cached, in chain order; ``parent_block_hash`` precedes the first."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class BlockRemoved(msgspec.Struct, tag=True):
    """Cached blocks evicted (their memory reused for other tokens)."""

    block_hashes: list[int]


class AllBlocksCleared(msgspec.Struct, tag=True):
    """The prefix cache was reset: the core holds no cached block any more."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct):
    """One step's events of one engine core (``data_parallel_rank``)."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(frame: bytes) -> KVEventBatch:
    return _decoder.decode(frame)
