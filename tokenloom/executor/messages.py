"""Typed messages between the engine core's executor and its tensor-parallel
workers (msgpack). Executor -> workers, on the broadcast channel:
``ExecuteModel`` each step, ``StopWorkers`` at the end. Workers -> executor, on
one PULL socket: ``WorkerReady`` once, ``StepDone`` (rank 0 only) each step,
``WorkerFailed`` from any rank that raised.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from tokenloom.config import CacheConfig, ModelConfig, SchedulerConfig
from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.outputs import ModelRunnerOutput
from tokenloom.structured_output.manager import GrammarOutput


class WorkerSpec(msgspec.Struct):
    """What a worker process is started with (on its stdin)."""

    rank: int
    world_size: int
    init_method: str  # torch.distributed rendezvous
    steps_address: str  # the broadcast channel
    replies_address: str
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig


class ExecuteModel(msgspec.Struct, tag=True):
    scheduler_output: SchedulerOutput
    grammar_output: GrammarOutput | None = None


class StopWorkers(msgspec.Struct, tag=True):
    pass


class WorkerReady(msgspec.Struct, tag=True):
    rank: int
    num_blocks: int
    max_model_len: int


class StepDone(msgspec.Struct, tag=True):
    output: ModelRunnerOutput


class WorkerFailed(msgspec.Struct, tag=True):
    rank: int
    message: str


StepMessage = ExecuteModel | StopWorkers
ReplyMessage = WorkerReady | StepDone | WorkerFailed


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):  # the grammar bitmask
        return (str(obj.dtype), list(obj.shape), obj.tobytes())
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        dtype, shape, data = obj
        return np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    raise NotImplementedError(f"cannot decode {kind.__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
step_decoder = msgspec.msgpack.Decoder(StepMessage, dec_hook=_dec_hook)  # type: ignore[arg-type]
reply_decoder = msgspec.msgpack.Decoder(ReplyMessage)  # type: ignore[arg-type]
spec_decoder = msgspec.msgpack.Decoder(WorkerSpec)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)
