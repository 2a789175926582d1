"""A tensor-parallel rank's process: ``python -m tokenloom.executor.worker_proc``
with a msgpack ``WorkerSpec`` on stdin.

It joins the process group, builds its ``ModelRunner`` shard, subscribes to
the step broadcast and then runs every step it receives; rank 0 sends each
step's output back (all ranks sample the same tokens, so every persistent
batch stays the same). On CPU each rank runs one thread, pinned to its own
core. It exits on ``StopWorkers``, and on its own when the engine core's
process is gone (a watchdog thread), so no worker outlives its engine.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback

import zmq

from tokenloom.executor.broadcast import StepReceiver
from tokenloom.executor.messages import (
    ExecuteModel,
    StepDone,
    StopWorkers,
    WorkerFailed,
    WorkerReady,
    WorkerSpec,
    encode,
    spec_decoder,
    step_decoder,
)

logger = logging.getLogger(__name__)

_PARENT_CHECK_S = 0.5


def _exit_with_parent() -> None:
    """Exit at once when the process that started us is gone (we get re-parented)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="tokenloom-tp-watchdog", daemon=True).start()


def _pin_to_own_cpu(rank: int) -> None:
    """One CPU per rank (round robin over the allowed ones) and one torch thread."""
    import torch

    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    torch.set_num_threads(1)


def run_worker(spec: WorkerSpec) -> None:
    import dataclasses

    import torch

    from tokenloom.distributed.parallel_state import (
        destroy_tensor_parallel,
        init_tensor_parallel,
    )
    from tokenloom.distributed.shard import partition
    from tokenloom.model.arch_reader import load_arch_config
    from tokenloom.model.paths import resolve_model_path
    from tokenloom.worker.model_runner import ModelRunner

    context = zmq.Context()
    replies = context.socket(zmq.PUSH)
    replies.setsockopt(zmq.SNDHWM, 0)
    replies.setsockopt(zmq.LINGER, 5000)
    replies.connect(spec.replies_address)
    model_config = spec.model_config
    if torch.device(model_config.device).type == "cuda":
        model_config = dataclasses.replace(model_config, device=f"cuda:{spec.rank}")
    else:
        _pin_to_own_cpu(spec.rank)
    receiver = None
    started = time.monotonic()
    try:
        path = resolve_model_path(
            model_config.model, model_config.revision, model_config.load_format != "dummy"
        )
        shard = partition(load_arch_config(path), spec.world_size, spec.rank)
        init_tensor_parallel(
            spec.rank, spec.world_size, spec.init_method, torch.device(model_config.device)
        )
        logger.info("rank %d joined the group in %.1fs", spec.rank, time.monotonic() - started)
        runner = ModelRunner(model_config, spec.cache_config, spec.scheduler_config, shard=shard)
        logger.info("rank %d loaded its shard in %.1fs", spec.rank, time.monotonic() - started)
        receiver = StepReceiver(spec.steps_address)
        replies.send(encode(WorkerReady(spec.rank, runner.num_blocks, runner.max_model_len)))
        while True:
            message = step_decoder.decode(receiver.recv())
            if isinstance(message, StopWorkers):
                break
            assert isinstance(message, ExecuteModel)
            output = runner.execute_model(message.scheduler_output, message.grammar_output)
            if spec.rank == 0:
                replies.send(encode(StepDone(output)))
    except Exception as exc:
        logger.exception("tensor-parallel worker %d failed", spec.rank)
        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        replies.send(encode(WorkerFailed(spec.rank, text)))
    finally:
        if receiver is not None:
            receiver.close()
        replies.close()
        context.term()
        destroy_tensor_parallel()


def main() -> None:
    _exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's business
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s tp-worker: %(message)s"
    )
    spec = spec_decoder.decode(sys.stdin.buffer.read())
    run_worker(spec)


if __name__ == "__main__":
    main()
