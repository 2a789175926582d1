"""Front end <-> engine core messages survive a msgpack round trip, typed."""

from __future__ import annotations

import msgspec
import pytest

from tokenloom.engine.messages import (
    AbortRequests,
    CoreError,
    CoreOutputs,
    EngineCoreRequest,
    Ready,
    Shutdown,
    StartupError,
    encode,
    handshake_decoder,
    input_decoder,
    output_decoder,
)
from tokenloom.outputs import EngineCoreOutput, EngineCoreOutputs, SchedulerStats, TokenLogprobs
from tokenloom.request import FinishReason
from tokenloom.sampling_params import SamplingParams


def test_input_messages_round_trip() -> None:
    params = SamplingParams(max_tokens=7, temperature=0.5, stop="x", stop_token_ids=[3], seed=11)
    request = EngineCoreRequest(
        "r1",
        [1, 2, 3],
        params,
        eos_token_id=2,
        arrival_time=12.5,
        priority=-1,
        tenant="team-a",
        tenant_weight=2.5,
    )
    for message in (request, AbortRequests(["a", "b"]), Shutdown()):
        decoded = input_decoder.decode(encode(message))
        assert type(decoded) is type(message)
        assert decoded == message
    decoded = input_decoder.decode(encode(request))
    assert isinstance(decoded.sampling_params, SamplingParams)
    assert decoded.sampling_params.stop == ["x"]
    assert (decoded.tenant, decoded.tenant_weight) == ("team-a", 2.5)


def test_output_messages_round_trip() -> None:
    outputs = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput(
                "r1",
                [5, 6],
                FinishReason.STOP,
                stop_reason=6,
                num_cached_tokens=16,
                new_logprobs=[TokenLogprobs([5, 9], [-0.1, -2.5])],
            ),
            EngineCoreOutput("r2", [7]),
        ],
        scheduler_stats=SchedulerStats(num_running_reqs=1, kv_cache_usage=0.25),
        finished_requests={"r1"},
    )
    message = CoreOutputs(outputs, {"r1": 2.0})
    decoded = output_decoder.decode(encode(message))
    assert decoded == message
    assert decoded.outputs.outputs[0].finish_reason is FinishReason.STOP
    assert isinstance(decoded.outputs.outputs[0].new_logprobs[0], TokenLogprobs)
    assert output_decoder.decode(encode(CoreError("boom"))) == CoreError("boom")


def test_handshake_round_trip() -> None:
    assert handshake_decoder.decode(encode(Ready(100, 2048))) == Ready(100, 2048)
    assert handshake_decoder.decode(encode(StartupError("no model"))) == StartupError("no model")


def test_invalid_sampling_params_are_rejected_on_decode() -> None:
    raw = msgspec.msgpack.encode(
        {
            "type": "EngineCoreRequest",
            "request_id": "r",
            "prompt_token_ids": [1],
            "sampling_params": {"temperature": -1.0},
            "eos_token_id": None,
            "arrival_time": 0.0,
        }
    )
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        input_decoder.decode(raw)


def test_pooling_requests_and_outputs_round_trip() -> None:
    from tokenloom.pooling_params import PoolingParams

    request = EngineCoreRequest(
        "e1",
        [1, 2, 3],
        SamplingParams(max_tokens=1),
        eos_token_id=None,
        arrival_time=1.0,
        pooling_params=PoolingParams(dimensions=8, normalize=True, skip_reading_prefix_cache=True),
    )
    decoded = input_decoder.decode(encode(request))
    assert decoded == request and isinstance(decoded.pooling_params, PoolingParams)
    vector = b"\x00\x00\x80?" * 8
    pooled = EngineCoreOutput("e1", [], FinishReason.STOP, pooling_output=vector)
    message = CoreOutputs(EngineCoreOutputs([pooled, EngineCoreOutput("g", [5])]))
    decoded_out = output_decoder.decode(encode(message))
    assert decoded_out == message
    assert decoded_out.outputs.outputs[0].pooling_output == vector
    # Fields at their defaults stay off the wire: a decode step's output is its id and token.
    assert msgspec.msgpack.decode(encode(EngineCoreOutput("g", [5]))) == {
        "request_id": "g",
        "new_token_ids": [5],
    }
