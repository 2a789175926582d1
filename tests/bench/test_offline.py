"""The offline runner's bookkeeping, against a stand-in for tokenloom.LLM (no model)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tokenloom import SamplingParams
from tokenloom.bench.datasets import BenchRequest
from tokenloom.bench.offline import format_offline, reset_prefix_cache, run_offline, warmup


@dataclass
class _Completion:
    token_ids: list[int]


@dataclass
class _Output:
    outputs: list[_Completion]
    num_cached_tokens: int


class FakeLLM:
    """Returns max_tokens tokens per prompt (or one fewer when ``short``)."""

    def __init__(self, short: bool = False) -> None:
        self.resets = 0
        self.calls: list[tuple[list, list[SamplingParams]]] = []
        self.short = short

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True

    def generate(self, prompts, params, use_tqdm=True):
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        self.calls.append((prompts, list(params)))
        n = [p.max_tokens - (1 if self.short else 0) for p in params]
        return [_Output([_Completion([7] * k)], num_cached_tokens=2) for k in n]


def test_run_offline_counts_returned_tokens():
    llm = FakeLLM()
    reqs = [BenchRequest([1, 2, 3, 4], 5), BenchRequest([5, 6], 3)]
    res = run_offline(llm, reqs)
    prompts, params = llm.calls[0]
    assert prompts == [[1, 2, 3, 4], [5, 6]]
    assert [p.max_tokens for p in params] == [5, 3]
    assert all(p.temperature == 0.0 and p.ignore_eos for p in params)
    assert res.total_input_tokens == 6 and res.total_output_tokens == 8
    assert res.expected_output_tokens == 8
    assert res.output_throughput == pytest.approx(8 / res.wall_s)
    assert res.prefix_cache_hit_rate == pytest.approx(4 / 6)
    assert res.peak_rss_mib > 10
    assert "Output tokens (returned / expected)" in format_offline(res)


def test_short_outputs_are_visible():
    res = run_offline(FakeLLM(short=True), [BenchRequest([1], 4)])
    assert res.total_output_tokens == 3 and res.expected_output_tokens == 4


def test_warmup_resets_the_prefix_cache():
    llm = FakeLLM()
    warmup(llm, num_requests=2, prompt_len=5, max_tokens=3)
    prompts, params = llm.calls[0]
    assert len(prompts) == 2 and all(len(p) == 5 for p in prompts)
    assert llm.resets == 1
    assert reset_prefix_cache(llm) is True and llm.resets == 2
