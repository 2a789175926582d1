"""Speculative decoding (n-gram) through the public front ends, beside features it
must not disturb: ``n > 1``, streaming with ``AsyncLLM`` and LoRA adapters.

Two ``LLM`` engines on the real default model in float32, one with speculation
and one without, both with LoRA enabled; greedy and seeded sampled outputs must
be identical and the speculating engine must have had drafts accepted (else
nothing was tested).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import peft
import pytest
import torch

from tests.engine.conftest import ENGINE_KWARGS
from tokenloom import LoRARequest, SamplingParams
from tokenloom.engine.args import EngineArgs
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.metrics.spec_decode import SpecDecodingSummary
from tokenloom.metrics.stats import IterationStats
from tokenloom.outputs import SchedulerStats

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
KWARGS: dict[str, Any] = {
    **ENGINE_KWARGS,
    "dtype": "float32",
    "enable_lora": True,
    "max_loras": 1,
    "max_lora_rank": 8,
}
# Prompts whose greedy continuations repeat some of their text (drafts accepted).
PROMPTS = [
    "The list: apple, banana, cherry. The list again: apple,",
    "def square(x):\n    return x * x\n\ndef cube(x):\n    return",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


class SpecCounter:
    """A stat logger that sums the verified drafts of every step."""

    def __init__(self) -> None:
        self.summary = SpecDecodingSummary()

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        if scheduler_stats is not None:
            self.summary.add(scheduler_stats.spec_decoding_stats)

    def accepted(self) -> int:
        return self.summary.num_accepted_tokens


@pytest.fixture(scope="module")
def plain(default_model_path: Path) -> Any:
    from tokenloom.engine.llm import LLM

    return LLM(str(default_model_path), **KWARGS)


@pytest.fixture(scope="module")
def spec(default_model_path: Path) -> Any:
    from tokenloom.engine.llm import LLM

    llm = LLM(str(default_model_path), speculative_config=SPEC, **KWARGS)
    llm.stat_loggers = [SpecCounter()]
    return llm


@pytest.fixture
def counter(spec: Any) -> Iterator[SpecCounter]:
    """The speculating engine's counts, from zero for each test."""
    spec.stat_loggers = [SpecCounter()]
    yield spec.stat_loggers[0]


def _tokens(outputs: list[Any]) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in out.outputs] for out in outputs]


def test_n_completions(plain: Any, spec: Any, counter: SpecCounter) -> None:
    (reference,) = plain.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    three = SamplingParams(n=3, temperature=0.0, max_tokens=24, ignore_eos=True)
    (out,) = spec.generate(PROMPTS[0], three, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [list(c.token_ids) for c in out.outputs] == [list(reference.outputs[0].token_ids)] * 3
    assert counter.accepted() > 0, counter.summary.describe()

    # Seeded random completions: each child its own seed, full length, and the
    # tokens plain decoding samples, however many drafts (a timing-dependent
    # number) each step verified; the second run's prompt is a prefix-cache hit.
    # A verified row's float32 logits differ from a plain decode row's in the
    # last bits (other matmul shapes), so a draw that lands that close to the
    # edge of a token's CDF interval may pick its neighbour; top_k keeps every
    # interval wide, where a full-vocabulary draw lands on a rare token's narrow
    # one often enough to flip a token on some CPUs.
    sampled = SamplingParams(n=2, temperature=0.8, top_k=20, seed=5, max_tokens=16, ignore_eos=True)
    expected = _tokens(plain.generate(PROMPTS[1], sampled, use_tqdm=False))
    assert _tokens(spec.generate(PROMPTS[1], sampled, use_tqdm=False)) == expected
    assert _tokens(spec.generate(PROMPTS[1], sampled, use_tqdm=False)) == expected
    children = expected[0]
    assert [len(t) for t in children] == [16, 16] and children[0] != children[1]


async def test_stream_deltas_reassemble_to_the_plain_text(plain: Any, spec: Any) -> None:
    references = plain.generate(PROMPTS, GREEDY, use_tqdm=False)
    counter = SpecCounter()
    engine = AsyncLLM.from_engine_args(
        EngineArgs(model=spec.engine_args.model, speculative_config=SPEC, **KWARGS),
        multiprocess=False,
        stat_loggers=[counter],
    )
    try:
        for i, (prompt, reference) in enumerate(zip(PROMPTS, references, strict=True)):
            deltas = [d async for d in engine.generate(prompt, GREEDY, f"s{i}", delta=True)]
            assert deltas[-1].finished and len(deltas) > 1
            final = reference.outputs[0]
            assert "".join(d.outputs[0].text for d in deltas) == final.text
            assert [t for d in deltas for t in d.outputs[0].token_ids] == list(final.token_ids)
    finally:
        engine.shutdown()
    assert counter.accepted() > 0, counter.summary.describe()


@pytest.fixture(scope="module")
def adapter(default_hf_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random rank-8 PEFT adapter on every projection of the default model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(default_hf_model_dir, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.04)
    out = tmp_path_factory.mktemp("spec_adapter")
    model.save_pretrained(out)
    return out


def test_lora_request_with_speculation_equals_without(
    plain: Any, spec: Any, counter: SpecCounter, adapter: Path
) -> None:
    lora = LoRARequest("random8", 1, str(adapter))
    reference = plain.generate(PROMPTS, GREEDY, lora_request=lora, use_tqdm=False)
    ours = spec.generate(PROMPTS, GREEDY, lora_request=lora, use_tqdm=False)
    assert _tokens(ours) == _tokens(reference)
    assert counter.accepted() > 0, counter.summary.describe()
    # The adapter matters: the base model answers differently.
    base = plain.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(base) != _tokens(reference)
