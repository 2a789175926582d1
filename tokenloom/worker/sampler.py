"""Turn a batch of logits into tokens, one row per sampled position.

Order: banned tokens (min_tokens), repetition penalty, presence/frequency
penalties, then greedy argmax for temperature-0 rows, or temperature, min-p,
top-k, top-p and a random draw for the others. The expensive steps (penalties,
sorting, logprobs) run only when some row needs them.

Random rows invert their CDF at one uniform draw per row (see top_k_top_p.py).
A seeded row draws it from its own generator, so its tokens do not depend on
what else is in the batch.

Logprobs are computed from the raw model logits (log_softmax before penalties,
temperature and truncation): they describe the model's distribution, as
OpenAI-style APIs report them, and are comparable across sampling settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.outputs import TokenLogprobs
from tokenloom.worker.sampling_metadata import SamplingMetadata
from tokenloom.worker.top_k_top_p import sample_full, sample_top_k_top_p

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [R] int64, on the logits' device
    logprobs: list[TokenLogprobs | None] | None  # per row; None when no row asked


class Sampler:
    """Stateless apart from the generator shared by unseeded rows."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row. ``logits`` ([R, V] float32) is modified in place."""
        raw_logprobs = None
        if metadata.num_logprobs is not None:
            raw_logprobs = RawLogprobs.capture(logits, metadata.num_logprobs)

        if metadata.banned_rows is not None:
            logits[metadata.banned_rows, metadata.banned_token_ids] = _NEG_INF
        if not metadata.no_penalties:
            logits = apply_penalties(logits, metadata)

        if metadata.all_greedy:
            sampled = greedy_tokens(logits)
        else:
            sampled = self._sample_random(logits, metadata)

        logprobs = None if raw_logprobs is None else raw_logprobs.gather(sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _sample_random(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        temperature = metadata.temperature
        greedy = None
        if not metadata.all_random:
            greedy = greedy_tokens(logits)
            temperature = torch.where(temperature == 0.0, 1.0, temperature)
        logits.div_(temperature.unsqueeze(1))
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        u = draw_uniform(logits.shape[0], metadata.generators, self.generator, logits.device)
        if metadata.top_k is not None or metadata.top_p is not None:
            sampled = sample_top_k_top_p(logits, u, metadata.top_k, metadata.top_p)
        else:
            sampled = sample_full(logits, u)
        if greedy is not None:
            sampled = torch.where(metadata.temperature == 0.0, greedy, sampled)
        return sampled


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of ties, NaN above all, as ``torch.argmax``).
    On CPU through numpy, whose argmax over a vocabulary's row is several times
    faster than torch's CPU argmax."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return logits.argmax(dim=-1)
    return torch.from_numpy(logits.numpy().argmax(axis=-1))


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition (HF: prompt + output, divide positive / multiply negative logits)
    then presence and frequency (OpenAI: output tokens only, subtracted)."""
    assert metadata.output_token_ids is not None
    assert metadata.repetition_penalties is not None
    assert metadata.presence_penalties is not None
    assert metadata.frequency_penalties is not None
    num_rows, vocab = logits.shape
    output_ids = metadata.output_token_ids
    counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]
    in_output = counts > 0

    rep = metadata.repetition_penalties
    if bool((rep != 1.0).any()):
        assert metadata.prompt_token_ids is not None
        seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, metadata.prompt_token_ids, True)
        seen = seen[:, :vocab] | in_output
        rep = rep.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)

    logits -= metadata.frequency_penalties.unsqueeze(1) * counts
    logits -= metadata.presence_penalties.unsqueeze(1) * in_output.to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's.

    p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p), so no softmax.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill_(logits < threshold, _NEG_INF)


def draw_uniform(
    num_rows: int,
    generators: dict[int, torch.Generator],
    default_generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """One float64 uniform per row; seeded rows draw from their own generator."""
    u = torch.rand(num_rows, dtype=torch.float64, device=device, generator=default_generator)
    for row, generator in generators.items():
        u[row] = torch.rand((), dtype=torch.float64, device=device, generator=generator)
    return u


def skip_draws(generator: torch.Generator, num_draws: int) -> None:
    """Advance a seeded row's generator past ``num_draws`` sampled positions.

    ``draw_uniform`` takes exactly one draw per sampled position of a seeded
    row, so a request resumed with ``num_draws`` outputs (crash recovery)
    continues with the draws it would have made had it never stopped. The
    draws are taken one by one, as ``draw_uniform`` takes them.
    """
    for _ in range(num_draws):
        torch.rand((), dtype=torch.float64, device=generator.device, generator=generator)


@dataclass
class RawLogprobs:
    """log_softmax of the raw logits of the rows that asked, taken before any change."""

    rows: list[int]
    num_logprobs: list[int]
    logprobs: torch.Tensor  # [len(rows), V]

    @classmethod
    def capture(cls, logits: torch.Tensor, num_logprobs: list[int]) -> RawLogprobs:
        rows = [i for i, k in enumerate(num_logprobs) if k >= 0]
        index = torch.tensor(rows, device=logits.device, dtype=torch.long)
        return cls(rows, num_logprobs, logits.index_select(0, index).log_softmax(dim=-1))

    def gather(self, sampled: torch.Tensor) -> list[TokenLogprobs | None]:
        """Per row: the sampled token's logprob, then the top k."""
        result: list[TokenLogprobs | None] = [None] * len(self.num_logprobs)
        if not self.rows:
            return result
        lp = self.logprobs
        index = torch.tensor(self.rows, device=lp.device, dtype=torch.long)
        chosen = sampled.index_select(0, index).unsqueeze(1)
        chosen_lp = lp.gather(1, chosen)
        k_max = max(self.num_logprobs[i] for i in self.rows)
        top_lp, top_ids = lp.topk(k_max, dim=-1)

        chosen_l, chosen_lp_l = chosen.squeeze(1).tolist(), chosen_lp.squeeze(1).tolist()
        top_lp_l, top_ids_l = top_lp.tolist(), top_ids.tolist()
        for j, row in enumerate(self.rows):
            k = self.num_logprobs[row]
            result[row] = TokenLogprobs(
                token_ids=[chosen_l[j], *top_ids_l[j][:k]],
                logprobs=[chosen_lp_l[j], *top_lp_l[j][:k]],
            )
        return result
