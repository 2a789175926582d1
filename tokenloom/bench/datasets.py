"""Seeded benchmark workloads: random, shared-prefix and user JSONL prompts.

Every generator is deterministic for a given seed and vocabulary, so two
engines (or two runs) fed the same arguments do exactly the same work.
Prompts are token-id lists drawn from the tokenizer's ordinary tokens
(special tokens excluded), which sidesteps decode/encode round trips that
would change prompt lengths between engines.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenloom.jsonl import iter_jsonl

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

LENGTH_DISTRIBUTIONS = ("fixed", "uniform", "log-uniform")


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: the prompt and how many tokens to generate."""

    prompt_token_ids: list[int]
    max_tokens: int
    prompt: str | None = None  # original text, for JSONL prompts

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class LengthSpec:
    """A length distribution: ``fixed`` uses ``high``; the others sample [low, high]."""

    dist: str
    low: int
    high: int

    def __post_init__(self) -> None:
        if self.dist not in LENGTH_DISTRIBUTIONS:
            raise ValueError(f"dist must be one of {LENGTH_DISTRIBUTIONS}, got {self.dist!r}")
        if self.low < 1:
            raise ValueError(f"low must be >= 1, got {self.low}")
        if self.high < self.low:
            raise ValueError(f"high must be >= low, got low={self.low} high={self.high}")

    @classmethod
    def from_ratio(cls, mean_len: int, range_ratio: float, dist: str = "uniform") -> LengthSpec:
        """vLLM-style spec: lengths in [mean*(1-ratio), mean*(1+ratio)]; ratio 0 is fixed."""
        if mean_len < 1:
            raise ValueError(f"random length must be >= 1, got {mean_len}")
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
        if range_ratio == 0.0:
            return cls("fixed", mean_len, mean_len)
        low = max(1, math.floor(mean_len * (1 - range_ratio)))
        high = max(low, math.ceil(mean_len * (1 + range_ratio)))
        return cls(dist, low, high)

    def sample(self, rng: random.Random) -> int:
        if self.dist == "fixed" or self.low == self.high:
            return self.high
        if self.dist == "uniform":
            return rng.randint(self.low, self.high)
        # log-uniform: uniform in log space over [low, high + 1), floored.
        x = math.exp(rng.uniform(math.log(self.low), math.log(self.high + 1)))
        return min(self.high, max(self.low, int(x)))


def usable_token_ids(vocab_size: int, special_ids: Sequence[int]) -> list[int]:
    """All ids in [0, vocab_size) that are not special tokens."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    special = set(special_ids)
    ids = [i for i in range(vocab_size) if i not in special]
    if not ids:
        raise ValueError("the vocabulary has no ordinary tokens")
    return ids


def _draw(rng: random.Random, vocab: Sequence[int], n: int) -> list[int]:
    return [vocab[rng.randrange(len(vocab))] for _ in range(n)]


def random_requests(
    num_requests: int,
    input_len: LengthSpec,
    output_len: LengthSpec,
    vocab: Sequence[int],
    seed: int = 0,
) -> list[BenchRequest]:
    """``num_requests`` prompts of random tokens with sampled prompt/output lengths."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        n_in = input_len.sample(rng)
        n_out = output_len.sample(rng)
        out.append(BenchRequest(_draw(rng, vocab, n_in), n_out))
    return out


def shared_prefix_requests(
    num_requests: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    vocab: Sequence[int],
    seed: int = 0,
) -> list[BenchRequest]:
    """``num_requests`` prompts behind one common ``prefix_len``-token system prompt.

    Each prompt is the shared prefix followed by ``suffix_len`` unique tokens;
    this is the workload a prefix cache should win on.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if prefix_len < 0 or suffix_len < 1:
        raise ValueError(
            f"need prefix_len >= 0 and suffix_len >= 1, got {prefix_len}, {suffix_len}"
        )
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    rng = random.Random(seed)
    prefix = _draw(rng, vocab, prefix_len)
    return [
        BenchRequest(prefix + _draw(rng, vocab, suffix_len), output_len)
        for _ in range(num_requests)
    ]


def jsonl_requests(
    path: str | Path,
    encode: Callable[[str], list[int]],
    default_max_tokens: int = 128,
    num_requests: int | None = None,
) -> list[BenchRequest]:
    """Prompts from a file with one ``{"prompt": str | [ids], "max_tokens"?: int}`` per line."""
    out: list[BenchRequest] = []
    for lineno, row in iter_jsonl(path):
        if not isinstance(row, dict) or "prompt" not in row:
            raise ValueError(f"{path}:{lineno}: each line needs a 'prompt' field")
        prompt = row["prompt"]
        max_tokens = int(row.get("max_tokens", default_max_tokens))
        if max_tokens < 1:
            raise ValueError(f"{path}:{lineno}: max_tokens must be >= 1")
        if isinstance(prompt, str):
            out.append(BenchRequest(encode(prompt), max_tokens, prompt=prompt))
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            out.append(BenchRequest(list(prompt), max_tokens))
        else:
            raise ValueError(f"{path}:{lineno}: prompt must be a string or a list of ints")
        if num_requests is not None and len(out) >= num_requests:
            break
    if not out:
        raise ValueError(f"{path}: no prompts found")
    return out


def save_workload(requests: Sequence[BenchRequest], path: str | Path) -> None:
    """Write a workload as JSON (what peer worker scripts read)."""
    Path(path).write_text(json.dumps([asdict(r) for r in requests]))


def load_workload(path: str | Path) -> list[BenchRequest]:
    return [BenchRequest(**row) for row in json.loads(Path(path).read_text())]


def load_tokenizer(model: str | None) -> PreTrainedTokenizerFast:
    """The engine's own tokenizer for an HF directory, a ``.gguf`` file or None (default model)."""
    from tokenloom.model.paths import resolve_model_path
    from tokenloom.model.tokenizer import load_tokenizer as load_model_tokenizer

    return load_model_tokenizer(resolve_model_path(model))


def tokenizer_vocab(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids a random prompt may use: the whole vocabulary minus special tokens."""
    specials = set(tokenizer.all_special_ids)
    # Added tokens (chat markers etc.) are special in practice even when not flagged so.
    specials.update(getattr(tokenizer, "added_tokens_decoder", {}).keys())
    return usable_token_ids(len(tokenizer), sorted(specials))
