"""Per-request sampling parameters (OpenAI / vLLM semantics)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tokenloom.structured_output.params import StructuredOutputsParams


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
    # vLLM's name: constrain the output to a JSON schema, regex, choice or grammar.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's name: arguments for engine extensions; "kv_transfer_params" goes to the
    # KV connector (prefill/decode disaggregation, see docs/kv_connectors.md).
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is not None:
            self.stop = list(self.stop)
        if self.stop_token_ids is not None:
            self.stop_token_ids = list(self.stop_token_ids)
        self._validate()
        # Stored as floats: a large int would not fit the 64-bit integers of msgpack.
        for name in _FLOAT_FIELDS:
            setattr(self, name, float(getattr(self, name)))

    def _validate(self) -> None:
        def fail(field: str, message: str) -> None:
            raise ValueError(f"{field} {message}, got {getattr(self, field)!r}")

        # Integers cross to the engine core as msgpack, which holds 64 bits at most.
        if self.max_tokens is not None and (not _is_int64(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "must be an integer in [1, 2**63) or None")
        if not _is_int64(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer in [0, 2**63)")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not _is_finite(self.temperature) or self.temperature < 0:
            fail("temperature", "must be a finite number >= 0")
        if not _is_finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if not _is_int64(self.top_k) or self.top_k < -1:
            fail("top_k", "must be -1, 0 (disabled) or a positive integer below 2**63")
        if not _is_finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if self.seed is not None and not (_is_int(self.seed) and -(2**63) <= self.seed < 2**64):
            fail("seed", "must be an integer in [-2**63, 2**64) or None")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite(value) or not -2.0 <= value <= 2.0:
                fail(name, "must be in [-2, 2]")
        if not _is_finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            fail("repetition_penalty", "must be a finite number > 0")
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be a non-empty string or a list of non-empty strings")
        if self.stop_token_ids is not None and not all(
            _is_int64(t) and t >= 0 for t in self.stop_token_ids
        ):
            fail("stop_token_ids", "must be a list of integers in [0, 2**63)")
        if not _is_int64(self.n) or self.n < 1:
            fail("n", "must be an integer in [1, 2**63)")
        if self.logprobs is not None and (not _is_int64(self.logprobs) or self.logprobs < 0):
            fail("logprobs", "must be an integer >= 0 or None")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            fail("structured_outputs", "must be a StructuredOutputsParams or None")
        if self.extra_args is not None:
            if not isinstance(self.extra_args, dict) or not all(
                isinstance(k, str) for k in self.extra_args
            ):
                fail("extra_args", "must be a dict with string keys or None")
            params = self.extra_args.get("kv_transfer_params")
            if params is not None and not isinstance(params, dict):
                fail("extra_args", "kv_transfer_params must be a JSON object")


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int64(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63


def _is_finite(value: object) -> bool:
    """A real number that is not NaN or infinite (both pass ordinary range checks)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond the float range
        return False
