"""KV cache events over ZMQ: each engine core publishes, the data parallel router subscribes.

A core sends one ``KVEventBatch`` per step that changed its prefix cache, as
a two-frame message (topic, msgpack batch) on a PUB socket. PUB/SUB drops
messages a subscriber is too slow (or too late) for, so whoever reads the
events treats them as hints, never as the truth about a core's cache.
"""

from __future__ import annotations

import time

import zmq

from tokenloom.core.kv_cache.events import KVCacheEvent, KVEventBatch, encode_batch

TOPIC = b"kv-events"


class KVEventPublisher:
    """Publishes one engine core's events; the socket connects to the subscriber's address."""

    def __init__(self, context: zmq.Context, address: str, data_parallel_rank: int) -> None:
        self.data_parallel_rank = data_parallel_rank
        self._socket = context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)

    def publish(self, events: list[KVCacheEvent]) -> None:
        if not events:
            return
        batch = KVEventBatch(time.time(), events, self.data_parallel_rank)
        try:
            self._socket.send_multipart([TOPIC, encode_batch(batch)], zmq.NOBLOCK)
        except zmq.Again:  # the subscriber lags: drop, the router copes
            pass

    def close(self) -> None:
        self._socket.close(linger=0)
