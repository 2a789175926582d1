"""The engine core in its own process, talking to the front end over ZMQ.

The loop drains input without blocking while there is work, runs one step,
and sends that step's outputs; when idle it blocks in ``zmq.Poller.poll`` so
an idle engine uses no CPU. It exits on a ``Shutdown`` message, when the
parent process dies, or after reporting an error in its own loop.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import zmq

from tokenloom import parent_death
from tokenloom.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig
from tokenloom.engine.messages import (
    AbortRequests,
    CoreError,
    EngineCoreRequest,
    Ready,
    RemoveLoRA,
    Shutdown,
    StartupError,
    encode,
    input_decoder,
)

if TYPE_CHECKING:
    from tokenloom.engine.core import EngineCore
    from tokenloom.engine.kv_events import KVEventPublisher

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 500
# While busy, the parent's liveness is checked every this many steps.
_PARENT_CHECK_STEPS = 64
# A step that scheduled nothing although requests remain: wait this long for input
# rather than spin.
_STALLED_POLL_MS = 5


def run_engine_core(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    input_address: str,
    output_address: str,
    handshake: Connection,
    die_with_parent: bool = True,
    lora_config: LoRAConfig | None = None,
    engine_index: int = 0,
    kv_events_address: str | None = None,
) -> None:
    """Process entry point: build the core, hand-shake, then serve until told to stop.

    ``kv_events_address``: where to publish KV cache events (data parallel
    routing), as core ``engine_index``; None publishes nothing.
    """
    if die_with_parent:  # the main thread started us (see die_with_parent)
        parent_death.die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front end's business
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine: %(message)s")
    try:
        from tokenloom.engine.core import EngineCore
        from tokenloom.model import huge_pages

        # Healthy as soon as the weights are in; the KV cache's pages follow.
        huge_pages.populate_in_background()
        core = EngineCore.from_config(
            model_config, cache_config, scheduler_config, lora_config, engine_index=engine_index
        )
    except BaseException as exc:
        message = f"engine core failed to start: {type(exc).__name__}: {exc}"
        handshake.send_bytes(encode(StartupError(message + "\n" + traceback.format_exc())))
        return

    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)
    input_socket.bind(input_address)
    handshake.send_bytes(encode(Ready(core.num_blocks, core.max_model_len)))
    handshake.close()
    serve_engine_core(core, context, input_socket, output_address, engine_index, kv_events_address)


def serve_engine_core(
    core: EngineCore,
    context: zmq.Context,
    input_socket: zmq.Socket,
    output_address: str,
    engine_index: int = 0,
    kv_events_address: str | None = None,
) -> None:
    """Serve a built core on its bound input socket until told to stop; then free everything."""
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)
    output_socket.setsockopt(zmq.LINGER, 1000)
    output_socket.connect(output_address)
    publisher = None
    if kv_events_address is not None:
        from tokenloom.engine.kv_events import KVEventPublisher

        core.enable_kv_events()
        publisher = KVEventPublisher(context, kv_events_address, engine_index)
    try:
        _serve(core, input_socket, output_socket, publisher)
    except Exception as exc:
        logger.exception("engine core loop failed")
        message = f"engine core failed: {type(exc).__name__}: {exc}"
        output_socket.send(encode(CoreError(message)))
    finally:
        core.shutdown()
        if publisher is not None:
            publisher.close()
        input_socket.close(linger=0)
        output_socket.close()
        context.term()


def _serve(
    core: EngineCore,
    input_socket: zmq.Socket,
    output_socket: zmq.Socket,
    publisher: KVEventPublisher | None = None,
) -> None:
    parent = multiprocessing.parent_process()
    poller = zmq.Poller()
    poller.register(input_socket, zmq.POLLIN)
    steps = 0
    stalled = False
    while True:
        busy = core.has_work()
        if busy and not stalled:
            timeout = 0
        else:
            timeout = _STALLED_POLL_MS if busy else _IDLE_POLL_MS
        aborted = False
        if poller.poll(timeout):
            while True:
                try:
                    frame = input_socket.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                message = input_decoder.decode(frame)
                if isinstance(message, EngineCoreRequest):
                    core.add_request(message)
                elif isinstance(message, AbortRequests):
                    core.abort_requests(message.request_ids)
                    aborted = True
                elif isinstance(message, RemoveLoRA):
                    core.remove_lora(message.lora_int_id)
                elif isinstance(message, Shutdown):
                    return
        steps += 1
        if (not busy or steps % _PARENT_CHECK_STEPS == 0) and not _parent_alive(parent):
            logger.info("front end process is gone; engine core exits")
            return

        result = core.step()
        if publisher is not None:
            publisher.publish(core.take_kv_events())
        if result is not None:
            output_socket.send(encode(result), copy=False)
            stalled = core.last_num_scheduled_tokens == 0 and core.has_work()
        elif aborted:
            # Nothing ran, but the gauges changed: let the front end see the freed cache.
            output_socket.send(encode(core.make_stats_output()), copy=False)


def _parent_alive(parent: multiprocessing.process.BaseProcess | None) -> bool:
    if parent is not None:
        return parent.is_alive()
    return os.getppid() != 1
