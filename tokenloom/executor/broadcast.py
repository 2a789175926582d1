"""The channel that carries each step from the engine core to every worker.

A ZMQ XPUB socket (bound by the engine core) and one SUB socket per worker,
over ipc on one machine. XPUB hears each subscription, so the publisher waits
until every worker has subscribed before the first step: a PUB/SUB message
sent earlier would be lost. High-water marks are off, so nothing is dropped
however far a worker falls behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq


class StepBroadcaster:
    """The engine core's end: ``publish`` sends one encoded message to every reader."""

    def __init__(self, address: str, num_readers: int) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.XPUB)
        self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscriber, not each topic
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self.address = address
        self.num_readers = num_readers
        self._subscribed = 0

    def wait_for_readers(self, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
        """Block until ``num_readers`` readers subscribed; RuntimeError if ``alive()``
        turns False or the time runs out first."""
        deadline = time.monotonic() + timeout_s
        while self._subscribed < self.num_readers:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(
                    f"{self._subscribed} of {self.num_readers} workers subscribed to the step "
                    f"broadcast within {timeout_s:.0f}s"
                )
            if not self._socket.poll(int(min(remaining, 0.5) * 1000)):
                if not alive():
                    raise RuntimeError("a worker exited before subscribing to the step broadcast")
                continue
            event = self._socket.recv()
            if event[:1] == b"\x01":  # subscribe (b"\x00": unsubscribe)
                self._subscribed += 1

    def publish(self, payload: bytes) -> None:
        self._socket.send(payload)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


class StepReceiver:
    """A worker's end."""

    def __init__(self, address: str) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(address)

    def poll(self, timeout_s: float) -> bool:
        """Whether a message arrived within ``timeout_s``."""
        return bool(self._socket.poll(int(timeout_s * 1000)))

    def recv(self) -> bytes:
        """The next message (blocks)."""
        return self._socket.recv()

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()
