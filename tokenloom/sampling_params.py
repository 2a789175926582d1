"""Per-request sampling parameters (OpenAI / vLLM semantics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise ``ValueError`` naming the field."""

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is not None:
            self.stop = list(self.stop)
        if self.stop_token_ids is not None:
            self.stop_token_ids = list(self.stop_token_ids)
        self._validate()

    def _validate(self) -> None:
        def fail(field: str, message: str) -> None:
            raise ValueError(f"{field} {message}, got {getattr(self, field)!r}")

        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not _is_number(self.temperature) or self.temperature < 0:
            fail("temperature", "must be >= 0")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            fail("top_k", "must be -1, 0 (disabled) or a positive integer")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            fail("seed", "must be an integer or None")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                fail(name, "must be in [-2, 2]")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            fail("repetition_penalty", "must be > 0")
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be a non-empty string or a list of non-empty strings")
        if self.stop_token_ids is not None and not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            fail("stop_token_ids", "must be a list of non-negative integers")
        if not _is_int(self.n) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            fail("logprobs", "must be an integer >= 0 or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
