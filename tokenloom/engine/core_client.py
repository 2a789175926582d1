"""How a front end reaches the engine core: directly, in a thread, or in another process.

- ``InprocClient``: synchronous direct calls (``LLM``, tests); it is given the
  ``EngineCore`` (``EngineCore.from_config`` for the real model runner).
- ``AsyncInprocClient``: the same core, stepped in a worker thread so the
  event loop stays responsive (``AsyncLLM(multiprocess=False)``).
- ``MPClient``: the core in its own process (``core_proc``), ZMQ sockets over
  ``ipc://`` in a private temp dir; process death is noticed at once because
  the process sentinel is polled together with the output socket.

The async clients share one surface: ``add_requests``, ``abort_requests``
(both non-blocking), ``await get_output()`` (raises ``EngineDeadError`` once
the core is gone), ``num_blocks``, ``max_model_len``, ``engine_core_pid``,
``is_alive()``, ``shutdown()``.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import shutil
import tempfile
import threading
import time
from collections import deque
from multiprocessing.connection import wait as wait_for_connections
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from tokenloom.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig
from tokenloom.engine.exceptions import EngineDeadError
from tokenloom.engine.messages import (
    AbortRequests,
    CoreError,
    CoreOutputs,
    EngineCoreRequest,
    Ready,
    RemoveLoRA,
    Shutdown,
    encode,
    handshake_decoder,
    output_decoder,
)

if TYPE_CHECKING:
    from tokenloom.engine.core import EngineCore

# An in-process core whose step scheduled nothing waits this long before the next.
_STALLED_SLEEP_S = 0.001


class InprocClient:
    """An engine core in this process, called directly."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.num_blocks = self.core.num_blocks
        self.max_model_len = self.core.max_model_len

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.core.abort_requests(request_ids)

    def remove_lora(self, lora_int_id: int) -> None:
        self.core.remove_lora(lora_int_id)

    def has_work(self) -> bool:
        return self.core.has_work()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.core.reset_prefix_cache(reset_running_requests)

    def step(self) -> CoreOutputs | None:
        result = self.core.step()
        if result is not None and self.core.last_num_scheduled_tokens == 0:
            # Requests wait (a grammar compiling, KV arriving): do not spin the CPU
            # the compile or the transfer needs.
            time.sleep(_STALLED_SLEEP_S)
        return result

    def make_stats_output(self) -> CoreOutputs:
        return self.core.make_stats_output()

    def shutdown(self) -> None:
        self.core.shutdown()


class AsyncInprocClient:
    """An in-process core for an event loop: steps run in a worker thread.

    Adds and aborts are queued and applied in that thread right before a
    step, under a lock, so the scheduler is only ever touched by one thread
    at a time (even by a step still running for an event loop that is gone).
    """

    engine_core_pid: int | None = None

    def __init__(self, client: InprocClient) -> None:
        self._client = client
        self.num_blocks = client.num_blocks
        self.max_model_len = client.max_model_len
        self._inbox: deque[EngineCoreRequest | AbortRequests | RemoveLoRA] = deque()
        self._lock = threading.Lock()
        self._wake: asyncio.Event | None = None
        self._wake_loop: asyncio.AbstractEventLoop | None = None
        self._dead: EngineDeadError | None = None
        self._closed = False

    def is_alive(self) -> bool:
        return self._dead is None and not self._closed

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._inbox.extend(requests)
        self._notify()

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._inbox.append(AbortRequests(list(request_ids)))
            self._notify()

    def remove_lora(self, lora_int_id: int) -> None:
        """Applied in the step thread, after the messages queued before it."""
        self._inbox.append(RemoveLoRA(lora_int_id))
        self._notify()

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _event(self) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if self._wake is None or self._wake_loop is not loop:
            self._wake, self._wake_loop = asyncio.Event(), loop
        return self._wake

    def _run_step(self) -> CoreOutputs | None:
        """Apply queued messages, then step; after aborts alone, report the freed cache."""
        with self._lock:
            aborted = False
            while self._inbox:
                message = self._inbox.popleft()
                if isinstance(message, AbortRequests):
                    self._client.abort_requests(message.request_ids)
                    aborted = True
                elif isinstance(message, RemoveLoRA):
                    self._client.remove_lora(message.lora_int_id)
                else:
                    self._client.add_request(message)
            if self._client.has_work():
                return self._client.step()
            return self._client.make_stats_output() if aborted else None

    async def get_output(self) -> CoreOutputs:
        wake = self._event()
        while True:
            if self._dead is not None:
                raise self._dead
            if self._closed:
                raise EngineDeadError("the engine was shut down")
            wake.clear()
            if not self._inbox and not self._client.has_work():
                await wake.wait()
                continue
            try:
                result = await asyncio.to_thread(self._run_step)
            except Exception as exc:
                self._dead = EngineDeadError(f"engine core failed: {type(exc).__name__}: {exc}")
                raise self._dead from exc
            if result is not None:
                return result

    def shutdown(self) -> None:
        with self._lock:  # let a running step finish
            self._closed = True
            self._client.shutdown()
        self._notify()


class MPClient:
    """The engine core in a spawned process.

    ``__init__`` starts the process and returns; ``wait_until_ready`` blocks
    until the core has loaded the model (so the front end can load the
    tokenizer meanwhile).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        lora_config: LoRAConfig | None = None,
        engine_index: int = 0,
        kv_events_address: str | None = None,
    ) -> None:
        """``engine_index``/``kv_events_address``: a data parallel core's rank and where it
        publishes KV cache events (see ``tokenloom.engine.data_parallel``)."""
        from tokenloom.engine.core_proc import run_engine_core

        self._tmpdir = tempfile.mkdtemp(prefix="tokenloom-")
        input_address = f"ipc://{self._tmpdir}/input"
        output_address = f"ipc://{self._tmpdir}/output"
        self._sync_context = zmq.Context()
        self._input = self._sync_context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        # Each sender connects and each receiver binds: a connecting socket queues
        # messages at once, before the peer is reachable, so no send ever fails.
        self._input.connect(input_address)
        self._async_context = zmq.asyncio.Context()
        self._output = self._async_context.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_address)

        mp = multiprocessing.get_context("spawn")
        self._handshake, writer = mp.Pipe(duplex=False)
        self.proc = mp.Process(
            target=run_engine_core,
            args=(model_config, cache_config, scheduler_config, input_address, output_address),
            kwargs={
                "handshake": writer,
                "die_with_parent": threading.current_thread() is threading.main_thread(),
                "lora_config": lora_config,
                "engine_index": engine_index,
                "kv_events_address": kv_events_address,
            },
            name=f"tokenloom-engine-core-{engine_index}",
            daemon=True,
        )
        self.proc.start()
        writer.close()
        self.engine_core_pid: int | None = self.proc.pid
        self.num_blocks = 0
        self.max_model_len = 0
        self._dead: EngineDeadError | None = None
        self._closed = False

    def wait_until_ready(self, timeout_s: float = 900.0) -> None:
        """Block until the core reports ready; raise if it fails or dies first."""
        deadline = time.monotonic() + timeout_s
        while not self._handshake.poll():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.shutdown()
                raise RuntimeError(f"engine core did not start within {timeout_s:.0f}s")
            wait_for_connections([self._handshake, self.proc.sentinel], timeout=remaining)
            if not self._handshake.poll() and not self.proc.is_alive():
                code = self.proc.exitcode
                self.shutdown()
                raise RuntimeError(f"engine core process exited during start-up (exit code {code})")
        message = handshake_decoder.decode(self._handshake.recv_bytes())
        self._handshake.close()
        if not isinstance(message, Ready):
            self.shutdown()
            raise RuntimeError(message.message)
        self.num_blocks = message.num_blocks
        self.max_model_len = message.max_model_len

    def is_alive(self) -> bool:
        return self._dead is None and not self._closed and self.proc.is_alive()

    def _send(self, message: EngineCoreRequest | AbortRequests | RemoveLoRA | Shutdown) -> None:
        if self._dead is not None:
            raise self._dead
        self._input.send(encode(message), zmq.NOBLOCK)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            self._send(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.is_alive():
            self._send(AbortRequests(list(request_ids)))

    def remove_lora(self, lora_int_id: int) -> None:
        if self.is_alive():
            self._send(RemoveLoRA(lora_int_id))

    def _mark_dead(self, reason: str) -> EngineDeadError:
        if self._dead is None:
            self._dead = EngineDeadError(reason)
        return self._dead

    async def get_output(self) -> CoreOutputs:
        """The next step's outputs; raises ``EngineDeadError`` as soon as the process is gone."""
        poller = zmq.asyncio.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        while True:
            if self._dead is not None:
                raise self._dead
            try:
                frame = await self._output.recv(zmq.NOBLOCK)
            except zmq.Again:
                if self._closed:
                    raise self._mark_dead("the engine was shut down") from None
                if not self.proc.is_alive():
                    code = self.proc.exitcode
                    raise self._mark_dead(
                        f"engine core process died unexpectedly (exit code {code})"
                    ) from None
                await poller.poll()
                continue
            message = output_decoder.decode(frame)
            if isinstance(message, CoreError):
                raise self._mark_dead(message.message)
            return message

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.proc.is_alive():
            try:
                self._input.send(encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._sync_context.term()
        self._async_context.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
