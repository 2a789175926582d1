"""The engine core's handle on its tensor-parallel workers: a ``ModelRunnerProtocol``
that runs each step on ``tensor_parallel_size`` worker processes.

``execute_model`` publishes the step (and the grammar bitmask, if any) on the
broadcast channel and waits for rank 0's output; a worker that raises or
dies fails the step with a RuntimeError naming it. The workers are plain
subprocesses (``python -m tokenloom.executor.worker_proc``), so an engine core
that is itself a daemon process may start them; they exit with it.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TypeVar

import zmq

from tokenloom.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig
from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.distributed.shard import partition
from tokenloom.executor.broadcast import StepBroadcaster
from tokenloom.executor.messages import (
    ExecuteModel,
    StepDone,
    StopWorkers,
    WorkerFailed,
    WorkerReady,
    WorkerSpec,
    encode,
    reply_decoder,
)
from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.model.arch_reader import load_arch_config
from tokenloom.model.paths import resolve_model_path
from tokenloom.outputs import ModelRunnerOutput
from tokenloom.structured_output.manager import GrammarOutput

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 900.0
_POLL_S = 0.5
_STOP_TIMEOUT_S = 10.0

_Reply = TypeVar("_Reply", WorkerReady, StepDone)


def check_tensor_parallel_support(
    arch: ModelArchConfig,
    tensor_parallel_size: int,
    scheduler_config: SchedulerConfig,
    lora_config: LoRAConfig | None,
) -> None:
    """ValueError, naming the field, for what tensor parallelism does not serve."""
    if lora_config is not None:
        raise ValueError("tensor_parallel_size > 1 does not support LoRA adapters (enable_lora)")
    if scheduler_config.speculative_config is not None:
        raise ValueError(
            "tensor_parallel_size > 1 does not support speculative decoding (speculative_config)"
        )
    partition(arch, tensor_parallel_size, 0)  # raises if the heads cannot be split


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class MultiprocExecutor:
    """Starts the workers and waits until every rank has its shard loaded.

    Public attributes, as ``ModelRunner``'s: ``num_blocks`` (agreed by all
    ranks), ``max_model_len``, ``model_path``, ``arch`` (the whole model's),
    ``eos_token_ids``; ``worker_pids``.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        world_size = model_config.parallel_config.tensor_parallel_size
        self.model_path = resolve_model_path(
            model_config.model, model_config.revision, model_config.load_format != "dummy"
        )
        self.arch = load_arch_config(self.model_path)
        self.eos_token_ids = tuple(self.arch.eos_token_ids)
        check_tensor_parallel_support(self.arch, world_size, scheduler_config, lora_config)
        self._tmpdir = tempfile.mkdtemp(prefix="tokenloom-tp-")
        self._broadcaster = StepBroadcaster(f"ipc://{self._tmpdir}/steps", world_size)
        self._context = zmq.Context()
        self._replies = self._context.socket(zmq.PULL)
        self._replies.setsockopt(zmq.RCVHWM, 0)
        self._replies.setsockopt(zmq.LINGER, 0)
        replies_address = f"ipc://{self._tmpdir}/replies"
        self._replies.bind(replies_address)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        env = dict(os.environ)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ranks of one core share a machine
        env["OMP_NUM_THREADS"] = "1"
        # The workers import this checkout of tokenloom, whatever the current directory.
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (package_root, env.get("PYTHONPATH"))))
        self._procs: list[subprocess.Popen[bytes]] = []
        self._stopped = False
        try:
            for rank in range(world_size):
                spec = WorkerSpec(
                    rank=rank,
                    world_size=world_size,
                    init_method=init_method,
                    steps_address=self._broadcaster.address,
                    replies_address=replies_address,
                    model_config=model_config,
                    cache_config=cache_config,
                    scheduler_config=scheduler_config,
                )
                proc = subprocess.Popen(
                    [sys.executable, "-m", "tokenloom.executor.worker_proc"],
                    stdin=subprocess.PIPE,
                    env=env,
                )
                assert proc.stdin is not None
                proc.stdin.write(encode(spec))
                proc.stdin.close()
                self._procs.append(proc)
            self.worker_pids = [proc.pid for proc in self._procs]
            ready = [self._receive(WorkerReady, _STARTUP_TIMEOUT_S) for _ in range(world_size)]
            self._broadcaster.wait_for_readers(_STARTUP_TIMEOUT_S, self._all_alive)
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = min(r.num_blocks for r in ready)
        self.max_model_len = min(r.max_model_len for r in ready)

    # --------------------------------------------------------- ModelRunnerProtocol

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        self._broadcaster.publish(encode(ExecuteModel(scheduler_output, grammar_output)))
        return self._receive(StepDone, None).output

    def remove_lora(self, lora_int_id: int) -> bool:
        return False  # refused at start-up: no adapter is ever loaded

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        return {}  # speculative decoding is refused at start-up

    # ---------------------------------------------------------------- lifecycle

    def exit_codes(self) -> list[int | None]:
        """Each worker's exit code (None while it runs)."""
        return [proc.poll() for proc in self._procs]

    def _all_alive(self) -> bool:
        return all(proc.poll() is None for proc in self._procs)

    def _receive(self, kind: type[_Reply], timeout_s: float | None) -> _Reply:
        """The next reply, which must be a ``kind``; RuntimeError if a worker failed,
        died or (with ``timeout_s``) took too long."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._replies.poll(int(_POLL_S * 1000)):
            self._raise_if_one_exited()
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not answer within {timeout_s}s")
        reply = reply_decoder.decode(self._replies.recv())
        if isinstance(reply, WorkerFailed):
            # A rank that lost a peer fails too: name the dead one, the cause.
            self._raise_if_one_exited()
            raise RuntimeError(f"tensor-parallel worker {reply.rank} failed: {reply.message}")
        if not isinstance(reply, kind):
            raise RuntimeError(f"expected {kind.__name__} from the workers, got {reply!r}")
        return reply

    def _raise_if_one_exited(self) -> None:
        for rank, proc in enumerate(self._procs):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"tensor-parallel worker {rank} exited (exit code {proc.returncode})"
                )

    def shutdown(self) -> None:
        """Stop the workers (killing any that do not exit in time); idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._all_alive():
            self._broadcaster.publish(encode(StopWorkers()))
            deadline = time.monotonic() + _STOP_TIMEOUT_S
        else:  # the others may be stuck in a collective with the dead one
            deadline = time.monotonic()
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._broadcaster.close()
        self._replies.close(linger=0)
        self._context.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
