"""A real run of the default model, recorded and replayed exactly.

Prompts share a long prefix (prefix-cache hits), the cache is small enough
to force preemptions, and outputs end at EOS or their length, as the model
decides; the replay through the real Scheduler, fed the recorded
(anonymised) tokens, must decide every step as the engine did.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenloom.core.sched.trace import read_trace
from tokenloom.engine.llm import LLM
from tokenloom.sampling_params import SamplingParams
from tokenloom.simulator.replay import replay

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PREFIX = (
    "You are a helpful assistant who answers questions about geography, history and "
    "science in short, plain sentences, and who always names a source. "
)
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "Who built the pyramids of Giza?",
    "How far is the Moon?",
    "What is the longest river in Africa?",
    "When did the Roman Empire fall?",
    "What is photosynthesis?",
    "Which planet has the most moons?",
]


def test_a_recorded_run_replays_exactly(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    llm = LLM(
        record_trace=str(path),
        num_blocks=12,
        max_num_seqs=6,
        max_num_batched_tokens=96,
        long_prefill_token_threshold=64,
        max_model_len=512,
    )
    # Half of them run to their length, so the cache fills; the others may stop at EOS.
    params = [
        SamplingParams(max_tokens=32 + 8 * (i % 4), temperature=0, ignore_eos=i % 2 == 0)
        for i in range(len(QUESTIONS))
    ]
    outputs = llm.generate([PREFIX + q for q in QUESTIONS], params, use_tqdm=False)
    llm.client.shutdown()

    trace = read_trace(path)
    assert len(trace.arrivals) == len(QUESTIONS)
    assert {f.finish for f in trace.finishes.values()} <= {"stop", "length"}
    assert any(step.preempted for step in trace.steps), "the cache never ran short"
    result = replay(trace)
    assert len(result.run.steps) == len(trace.steps)
    by_id = {trace.arrivals[r.index].request_id: r for r in result.run.requests}
    for output in outputs:
        replayed = by_id[output.request_id]  # n=1: the core runs it under the same id
        assert replayed.num_output_tokens == len(output.outputs[0].token_ids)
    # The shared prefix was hit as it was in the real run.
    assert (
        sum(r.num_cached_tokens for r in result.run.requests)
        == sum(o.num_cached_tokens for o in outputs)
        > 0
    )
