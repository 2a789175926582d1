"""The step broadcast channel: every worker gets every step, in order, intact."""

from __future__ import annotations

import numpy as np
import pytest

from tokenloom.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenloom.executor.broadcast import StepBroadcaster, StepReceiver
from tokenloom.executor.messages import ExecuteModel, StopWorkers, encode, step_decoder
from tokenloom.lora_request import LoRARequest
from tokenloom.sampling_params import SamplingParams
from tokenloom.structured_output.manager import GrammarOutput


def _step(i: int) -> ExecuteModel:
    output = SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(
                f"new-{i}",
                [1, 2, 3 + i],
                SamplingParams(temperature=0.5, seed=i, stop=["x"], logprobs=2),
                [4, 5],
                num_computed_tokens=16,
                stopping_token_ids=frozenset({2}),
                lora_request=LoRARequest("a", 1, "/tmp/a"),
            )
        ],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=["old"],
            resumed_req_ids={"old"},
            new_token_ids=[[7, 8]],
            new_block_ids=[[9]],
            num_computed_tokens=[32],
        ),
        num_scheduled_tokens={f"new-{i}": 3, "old": 1},
        total_num_scheduled_tokens=4,
        scheduled_spec_decode_tokens={"old": [5]},
        num_common_prefix_blocks=0,
        preempted_req_ids={"gone"},
        finished_req_ids={"done"},
    )
    bitmask = np.arange(2 * 3, dtype=np.int32).reshape(2, 3) - i
    return ExecuteModel(output, GrammarOutput([f"new-{i}"], bitmask, [2]))


@pytest.fixture
def address(tmp_path: object) -> str:
    return f"ipc://{tmp_path}/steps"


def test_every_reader_gets_every_step_in_order(address: str) -> None:
    broadcaster = StepBroadcaster(address, num_readers=2)
    readers = [StepReceiver(address), StepReceiver(address)]
    try:
        broadcaster.wait_for_readers(timeout_s=10)
        sent = [_step(i) for i in range(3)]
        for message in sent:
            broadcaster.publish(encode(message))
        broadcaster.publish(encode(StopWorkers()))
        for reader in readers:
            for expected in sent:
                assert reader.poll(timeout_s=10)
                got = step_decoder.decode(reader.recv())
                assert isinstance(got, ExecuteModel)
                assert got.scheduler_output == expected.scheduler_output
                assert got.grammar_output is not None and expected.grammar_output is not None
                np.testing.assert_array_equal(
                    got.grammar_output.grammar_bitmask, expected.grammar_output.grammar_bitmask
                )
                assert got.grammar_output.rows_per_request == [2]
            assert reader.poll(timeout_s=10)
            assert isinstance(step_decoder.decode(reader.recv()), StopWorkers)
            assert not reader.poll(timeout_s=0.05)
    finally:
        for reader in readers:
            reader.close()
        broadcaster.close()


def test_waiting_for_readers_fails_when_one_never_subscribes(address: str) -> None:
    broadcaster = StepBroadcaster(address, num_readers=2)
    reader = StepReceiver(address)
    try:
        with pytest.raises(RuntimeError, match="1 of 2 workers subscribed"):
            broadcaster.wait_for_readers(timeout_s=1.5)
        with pytest.raises(RuntimeError, match="exited before subscribing"):
            broadcaster.wait_for_readers(timeout_s=30, alive=lambda: False)
    finally:
        reader.close()
        broadcaster.close()
