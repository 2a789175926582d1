"""Offline throughput: a whole workload through ``tokenloom.LLM.generate`` at once.

Prompts go in as token ids with greedy decoding, ``ignore_eos`` and a fixed
``max_tokens`` each, so the work done is fully determined by the workload.
A short warm-up (excluded from timing) runs first, and the prefix cache is
reset afterwards, so the warm-up never feeds the timed run's cache.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tokenloom.bench.datasets import BenchRequest
from tokenloom.metrics.spec_decode import SpecDecodingSummary
from tokenloom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenloom.outputs import RequestOutput, SchedulerStats


class OfflineEngine(Protocol):
    """What the runner needs of ``tokenloom.LLM``."""

    def generate(
        self,
        prompts: list[list[int]],
        sampling_params: list[SamplingParams] | SamplingParams,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]: ...

    def reset_prefix_cache(self) -> bool: ...


@dataclass(frozen=True)
class OfflineResult:
    num_requests: int
    total_input_tokens: int
    total_output_tokens: int  # counted from what the engine returned
    expected_output_tokens: int  # sum of max_tokens
    wall_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    peak_rss_mib: float
    # Speculative decoding (all 0 when nothing was drafted).
    spec_num_drafts: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_acceptance_length: float = 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_cached_tokens / self.total_input_tokens if self.total_input_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        return d


def peak_rss_mib() -> float:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def sampling_params_for(requests: Sequence[BenchRequest]) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests
    ]


def reset_prefix_cache(llm: OfflineEngine) -> bool:
    """Forget the prefix cache, so a repeated workload starts cold; False if it could not."""
    return llm.reset_prefix_cache()


def warmup(
    llm: OfflineEngine, num_requests: int = 4, prompt_len: int = 32, max_tokens: int = 8
) -> None:
    """Run a few tiny requests so lazy initialisation is not timed."""
    if num_requests <= 0:
        return
    prompts = [[100 + i + j for j in range(prompt_len)] for i in range(num_requests)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    reset_prefix_cache(llm)


def run_offline(llm: OfflineEngine, requests: Sequence[BenchRequest]) -> OfflineResult:
    """Generate the whole workload in one ``generate`` call and time it."""
    prompts = [r.prompt_token_ids for r in requests]
    params = sampling_params_for(requests)
    spec = SpecDecodingSummary()
    # tokenloom.LLM hands every step's stats to its stat loggers: listen in for the drafts.
    loggers = getattr(llm, "stat_loggers", None)
    listener = _SpecListener(spec)
    if loggers is not None:
        loggers.append(listener)
    t0 = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        if loggers is not None:
            loggers.remove(listener)
    wall = time.perf_counter() - t0
    if len(outputs) != len(requests):
        raise RuntimeError(f"expected {len(requests)} outputs, got {len(outputs)}")
    n_in = sum(r.prompt_len for r in requests)
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    cached = sum(max(0, o.num_cached_tokens) for o in outputs)
    return OfflineResult(
        num_requests=len(requests),
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        expected_output_tokens=sum(r.max_tokens for r in requests),
        wall_s=wall,
        request_throughput=len(requests) / wall,
        output_throughput=n_out / wall,
        total_token_throughput=(n_in + n_out) / wall,
        num_cached_tokens=cached,
        peak_rss_mib=peak_rss_mib(),
        spec_num_drafts=spec.num_drafts,
        spec_acceptance_rate=spec.acceptance_rate,
        spec_mean_acceptance_length=spec.mean_acceptance_length,
    )


class _SpecListener:
    def __init__(self, summary: SpecDecodingSummary) -> None:
        self.summary = summary

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: object) -> None:
        if scheduler_stats is not None:
            self.summary.add(scheduler_stats.spec_decoding_stats)


def format_offline(result: OfflineResult) -> str:
    r = result
    rows = [
        ("Requests", f"{r.num_requests}"),
        ("Input tokens", f"{r.total_input_tokens}"),
        (
            "Output tokens (returned / expected)",
            f"{r.total_output_tokens} / {r.expected_output_tokens}",
        ),
        ("Wall time (s)", f"{r.wall_s:.2f}"),
        ("Request throughput (req/s)", f"{r.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{r.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{r.total_token_throughput:.2f}"),
        ("Prefix cache hit rate", f"{r.prefix_cache_hit_rate:.1%}"),
        ("Peak RSS (MiB)", f"{r.peak_rss_mib:.0f}"),
    ]
    if r.spec_num_drafts:
        rows += [
            ("Spec decode acceptance rate", f"{r.spec_acceptance_rate:.1%}"),
            ("Spec decode mean acceptance length", f"{r.spec_mean_acceptance_length:.2f}"),
        ]
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(f"{k:<{width}}{v:>16}" for k, v in rows)
