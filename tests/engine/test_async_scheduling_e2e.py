"""``--async-scheduling`` on the default model: the same outputs as the synchronous
engine, for greedy, seeded, penalised, logprob and structured requests, through
chunked prefill and preemption; and the combinations it refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tokenloom.engine.llm import LLM
from tokenloom.sampling_params import SamplingParams
from tokenloom.structured_output import StructuredOutputsParams

# Few blocks and a small token budget: prompts are chunked and requests preempted.
ENGINE = dict(num_blocks=10, max_model_len=140, max_num_batched_tokens=48, log_stats=False)

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "List three colours:",
    "In 1969, the first person to walk on the moon was",
    "def fibonacci(n):",
    "Translate to French: good morning",
]


def sampling() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, min_tokens=10),
        SamplingParams(temperature=0.0, max_tokens=32, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
        SamplingParams(
            temperature=0.0,
            max_tokens=20,
            structured_outputs=StructuredOutputsParams(choice=["bonjour", "salut"]),
        ),
    ]


def run(model: Path, **engine: Any) -> list[Any]:
    llm = LLM(str(model), **ENGINE, **engine)
    preemptions = [0]
    preempt = llm.client.core.scheduler._preempt

    def counted(index: int) -> None:
        preemptions[0] += 1
        preempt(index)

    llm.client.core.scheduler._preempt = counted
    outputs = llm.generate(PROMPTS, sampling(), use_tqdm=False)
    core = llm.client.core
    # A pipelined engine may hold one more step, launched before the last outputs
    # came in; it finishes nothing, and then the engine is idle with its cache free.
    for _ in range(2):
        if core.has_work():
            assert not core.step().outputs.outputs
    assert not core.has_work()
    assert core.scheduler.kv_cache_manager.usage == 0
    return [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs) for o in outputs
    ], preemptions[0]


@pytest.mark.e2e
def test_async_scheduling_gives_the_synchronous_outputs(default_model_path: Path) -> None:
    expected, _ = run(default_model_path)
    got, preemptions = run(default_model_path, async_scheduling=True)
    assert preemptions > 0
    for (tokens, reason, logprobs), (want, want_reason, want_logprobs) in zip(
        got, expected, strict=True
    ):
        assert tokens == want and reason == want_reason
        if want_logprobs is not None:
            assert logprobs is not None
            for mine, theirs in zip(logprobs, want_logprobs, strict=True):
                assert mine.keys() == theirs.keys()
                for token in theirs:
                    assert mine[token] == pytest.approx(theirs[token], abs=1e-4)


@pytest.mark.parametrize(
    ("extra", "conflict"),
    [
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative"),
        ({"runner": "pooling"}, "pooling"),
        ({"kv_offload_dir": "/tmp/unused-tier"}, "kv_transfer_config"),
    ],
)
def test_async_scheduling_refuses_what_needs_each_step_done(extra: dict, conflict: str) -> None:
    from tokenloom.engine.args import EngineArgs

    with pytest.raises(ValueError, match=f"async_scheduling cannot be combined with .*{conflict}"):
        _ = EngineArgs(None, async_scheduling=True, **extra).config
