"""Typed messages between the front end and the engine core process (msgpack, not pickle).

Front -> core: ``EngineCoreRequest``, ``AbortRequests``, ``Shutdown`` on one
socket, told apart by a tag. Core -> front: ``CoreOutputs`` after each step, or
``CoreError`` when the core loop failed. The start-up handshake (``Ready`` or
``StartupError``) travels over a pipe before the sockets are used.
"""

from __future__ import annotations

import msgspec

from tokenloom.lora_request import LoRARequest
from tokenloom.multimodal.inputs import MultiModalFeatureSpec
from tokenloom.outputs import EngineCoreOutputs
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, tag=True):
    """A tokenized, validated request, ready for the scheduler.

    ``prior_output_token_ids``: tokens an earlier engine core already produced
    for it (crash recovery, ``tokenloom.engine.recovery``); the core recomputes
    them like a preemption and continues after them. ``mm_features``: the
    prompt's images, processed (``tokenloom.multimodal.inputs``). ``tenant`` and
    ``tenant_weight``: who sent it and that tenant's share under the fair policy.
    ``pooling_params``: an embedding request, finished with its pooled vector.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    lora_request: LoRARequest | None = None
    prior_output_token_ids: list[int] = []
    mm_features: list[MultiModalFeatureSpec] | None = None
    tenant: str = ""
    tenant_weight: float = 1.0
    # A pooling request (``sampling_params`` is then unused); None: it generates.
    pooling_params: PoolingParams | None = None


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class RemoveLoRA(msgspec.Struct, tag=True):
    """Drop an unloaded LoRA adapter's weights (no request uses it any more)."""

    lora_int_id: int


class Shutdown(msgspec.Struct, tag=True):
    pass


class CoreOutputs(msgspec.Struct, tag=True):
    """One step's outputs, plus when requests that got their first token were first scheduled.

    ``engine_index``: which data parallel core produced them (set by the front end).
    """

    outputs: EngineCoreOutputs
    first_scheduled_times: dict[str, float] = {}
    engine_index: int = 0


class CoreError(msgspec.Struct, tag=True):
    """The core loop raised; the process exits after sending this."""

    message: str


class Ready(msgspec.Struct, tag=True):
    """The core built its model and cache; ``max_model_len`` already fits the cache."""

    num_blocks: int
    max_model_len: int


class StartupError(msgspec.Struct, tag=True):
    message: str


InputMessage = EngineCoreRequest | AbortRequests | RemoveLoRA | Shutdown
OutputMessage = CoreOutputs | CoreError
HandshakeMessage = Ready | StartupError

_encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(InputMessage)
output_decoder = msgspec.msgpack.Decoder(OutputMessage)
handshake_decoder = msgspec.msgpack.Decoder(HandshakeMessage)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)
