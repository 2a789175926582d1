"""Engine arguments: one flat dataclass shared by ``LLM``, ``AsyncLLM`` and the CLI.

It is split into the frozen config dataclasses by ``create_configs``; those do
the range checks, and their messages are rewritten here to name the argument.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from tokenloom.config import (
    QUANTIZATION_METHODS,
    CacheConfig,
    DPLoadBalanceConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    RecoveryConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenloom.default_model import DEFAULT_MODEL_NAME

# Argument name -> the config field that holds it, where the two differ.
_RENAMED = {
    "kv_cache_memory_fraction": "memory_fraction",
    "kv_cache_memory_bytes": "memory_bytes",
    "kv_cache_dtype": "cache_dtype",
}
_INT_FIELDS = (
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "long_prefill_token_threshold",
    "seed",
    "max_logprobs",
    "max_loras",
    "max_lora_rank",
    "data_parallel_size",
    "dp_load_margin",
)
_OPTIONAL_INT_FIELDS = ("max_model_len", "num_blocks", "kv_cache_memory_bytes")
_BOOL_FIELDS = (
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "log_stats",
    "enable_lora",
)
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?|mps)$")


@dataclass
class EngineArgs:
    """Everything needed to build an engine. Invalid values raise ``ValueError`` naming the field."""

    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    seed: int = 0
    kv_cache_memory_fraction: float = 0.1
    # vLLM's name: the KV cache's size in bytes instead of a fraction of free memory.
    kv_cache_memory_bytes: int | None = None
    device: str = "cpu"
    log_stats: bool = True
    served_model_name: str | None = None
    # Hugging Face revision (branch, tag or commit) of a model given by its id.
    revision: str | None = None
    # LoRA (vLLM's names): adapters in one step, their largest rank.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # Default chat template: a file path or the Jinja template itself (else the model's).
    chat_template: str | None = None
    # Most top logprobs a request may ask for.
    max_logprobs: int = 20
    # vLLM's speculative_config: a dict, its JSON text, or a SpeculativeConfig (None: off).
    speculative_config: dict[str, Any] | str | SpeculativeConfig | None = None
    # Data parallel (vLLM's names): engine cores, how they run, how requests pick one.
    data_parallel_size: int = 1
    data_parallel_backend: str = "mp"
    dp_load_balance: str = "prefix"
    dp_load_margin: int = 8
    # Crash recovery (RecoveryConfig): engine core restarts and the wait before them.
    max_engine_restarts: int = 3
    engine_restart_backoff_s: float = 1.0
    # Tensor parallelism: ranks (worker processes) that split every layer.
    tensor_parallel_size: int = 1
    # dtype of the paged KV cache (vLLM's name): auto (the model's), float32, bfloat16, float16.
    kv_cache_dtype: str = "auto"
    # vLLM's name: None (a GGUF runs quantized unless dtype names a float type),
    # "gguf", or "int8"/"int4" to quantize a float checkpoint at load time.
    quantization: str | None = None

    def __post_init__(self) -> None:
        self._check_types()
        self.create_configs()
        self.create_lora_config()
        self.create_parallel_config()
        self.create_dp_load_balance_config()
        self.create_recovery_config()
        self.load_chat_template()

    def load_chat_template(self) -> str | None:
        """The default chat template's text (``chat_template`` read if it is a path)."""
        from tokenloom.engine.chat_template import load_chat_template

        return load_chat_template(self.chat_template)

    def _check_types(self) -> None:
        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        for name in _INT_FIELDS:
            if not is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in _OPTIONAL_INT_FIELDS:
            value = getattr(self, name)
            if value is not None and not is_int(value):
                raise ValueError(f"{name} must be an integer or None, got {value!r}")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model must be a path string or None, got {self.model!r}")
        fraction = self.kv_cache_memory_fraction
        if not isinstance(fraction, (int, float)) or isinstance(fraction, bool):
            raise ValueError(f"kv_cache_memory_fraction must be a number, got {fraction!r}")
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            raise ValueError(
                f"device must be 'cpu', 'cuda', 'cuda:N' or 'mps', got {self.device!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be None or >= 2, got {self.max_model_len}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.served_model_name is not None and not (
            isinstance(self.served_model_name, str) and self.served_model_name
        ):
            raise ValueError(
                f"served_model_name must be a non-empty string or None, got {self.served_model_name!r}"
            )

    def get_served_model_name(self) -> str:
        """The name clients use: ``served_model_name``, else the model path as given."""
        if self.served_model_name:
            return self.served_model_name
        return self.model if self.model is not None else DEFAULT_MODEL_NAME

    def create_configs(self) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
        """Split into the configs the engine core is built from."""
        try:
            model_config = ModelConfig(
                model=self.model,
                dtype=self.dtype,  # type: ignore[arg-type]
                max_model_len=self.max_model_len,
                device=self.device,
                seed=self.seed,
                revision=self.revision,
                parallel_config=self.create_parallel_config(),
                quantization=self.quantization,  # type: ignore[arg-type]
            )
            cache_config = CacheConfig(
                block_size=self.block_size,
                num_blocks=self.num_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
                memory_fraction=float(self.kv_cache_memory_fraction),
                memory_bytes=self.kv_cache_memory_bytes,
                cache_dtype=self.kv_cache_dtype,  # type: ignore[arg-type]
            )
            scheduler_config = SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.policy,  # type: ignore[arg-type]
                speculative_config=self._speculative_config(),
            )
        except ValueError as exc:
            message = str(exc)
            for arg_name, config_name in _RENAMED.items():
                if message.startswith(config_name):
                    message = arg_name + message[len(config_name) :]
            raise ValueError(message) from None
        return model_config, cache_config, scheduler_config

    def create_lora_config(self) -> LoRAConfig | None:
        """The LoRA limits when ``enable_lora``, else None."""
        if not self.enable_lora:
            return None
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank)

    def create_parallel_config(self) -> ParallelConfig:
        """Tensor parallel ranks per core, data parallel cores and their backend."""
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            data_parallel_size=self.data_parallel_size,
            data_parallel_backend=self.data_parallel_backend,  # type: ignore[arg-type]
        )

    def create_dp_load_balance_config(self) -> DPLoadBalanceConfig:
        """How requests pick a data parallel engine core."""
        return DPLoadBalanceConfig(
            policy=self.dp_load_balance,  # type: ignore[arg-type]
            load_margin=self.dp_load_margin,
        )

    def create_recovery_config(self) -> RecoveryConfig:
        """How a dead engine core is restarted (``max_engine_restarts`` 0: it is not)."""
        return RecoveryConfig(
            max_engine_restarts=self.max_engine_restarts,
            engine_restart_backoff_s=self.engine_restart_backoff_s,
        )

    def _speculative_config(self) -> SpeculativeConfig | None:
        """Parse and check ``speculative_config``, the draft model's path included."""
        value = self.speculative_config
        if value is None:
            return None
        if isinstance(value, str):
            config = SpeculativeConfig.from_json(value)
        else:
            config = SpeculativeConfig.from_dict(value)
        if config.model is not None:
            from tokenloom.model.paths import resolve_model_path

            try:
                resolve_model_path(config.model)
            except (OSError, ValueError) as exc:
                raise ValueError(f"speculative_config.model: {exc}") from None
        return config

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one ``--flag`` per field (``--model`` for the model path)."""
        d = EngineArgs  # class attributes hold the defaults
        group = parser.add_argument_group("engine")
        group.add_argument(
            "--model",
            type=str,
            default=d.model,
            help="HF model directory or .gguf file (default: bundled SmolLM2-135M-Instruct)",
        )
        group.add_argument(
            "--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=d.dtype
        )
        group.add_argument(
            "--max-model-len", type=int, default=d.max_model_len, help="context length cap"
        )
        group.add_argument("--block-size", type=int, default=d.block_size)
        group.add_argument(
            "--num-blocks",
            type=int,
            default=d.num_blocks,
            help="KV cache blocks (default: sized from --kv-cache-memory-bytes, else "
            "--kv-cache-memory-fraction)",
        )
        group.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=d.enable_prefix_caching,
        )
        group.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
        group.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
        group.add_argument(
            "--enable-chunked-prefill",
            action=argparse.BooleanOptionalAction,
            default=d.enable_chunked_prefill,
        )
        group.add_argument(
            "--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold
        )
        group.add_argument("--policy", choices=["fcfs", "priority"], default=d.policy)
        group.add_argument("--seed", type=int, default=d.seed)
        group.add_argument(
            "--kv-cache-memory-fraction", type=float, default=d.kv_cache_memory_fraction
        )
        group.add_argument(
            "--kv-cache-memory-bytes",
            type=int,
            default=d.kv_cache_memory_bytes,
            help="KV cache size in bytes (default: --kv-cache-memory-fraction of free memory)",
        )
        group.add_argument("--device", type=str, default=d.device)
        group.add_argument(
            "--log-stats", action=argparse.BooleanOptionalAction, default=d.log_stats
        )
        group.add_argument("--served-model-name", type=str, default=d.served_model_name)
        group.add_argument(
            "--revision",
            type=str,
            default=d.revision,
            help="branch, tag or commit of a Hugging Face model id",
        )
        group.add_argument(
            "--enable-lora",
            action=argparse.BooleanOptionalAction,
            default=d.enable_lora,
            help="serve LoRA adapters (PEFT directories) on top of the model",
        )
        group.add_argument(
            "--max-loras", type=int, default=d.max_loras, help="most LoRA adapters in one batch"
        )
        group.add_argument(
            "--max-lora-rank", type=int, default=d.max_lora_rank, help="largest LoRA rank served"
        )
        group.add_argument(
            "--speculative-config",
            type=str,
            default=None,
            help='speculative decoding as JSON, vLLM\'s keys: {"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5} '
            'or {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}; '
            "optional disable_by_batch_size",
        )
        group.add_argument(
            "--chat-template",
            type=str,
            default=d.chat_template,
            help="default chat template: a Jinja file, or the template itself "
            "(default: the model's own)",
        )
        group.add_argument(
            "--quantization",
            choices=list(QUANTIZATION_METHODS),
            default=d.quantization,
            help="run on quantized weights: gguf (a .gguf file's own, the default for GGUF "
            "files unless --dtype names a float type), int8 or int4 (quantize a float "
            "checkpoint at load time)",
        )
        group.add_argument(
            "--max-logprobs",
            type=int,
            default=d.max_logprobs,
            help="most top logprobs a request may ask for",
        )
        group.add_argument(
            "--data-parallel-size",
            "-dp",
            type=int,
            default=d.data_parallel_size,
            help="engine cores, each with its own scheduler and KV cache, behind one front end",
        )
        group.add_argument(
            "--data-parallel-backend",
            choices=["mp", "ray"],
            default=d.data_parallel_backend,
            help="run the data parallel cores as local processes or as Ray actors "
            "(pip install tokenloom[ray]; joins a running Ray cluster if there is one)",
        )
        group.add_argument(
            "--dp-load-balance",
            choices=["prefix", "round_robin", "least_load"],
            default=d.dp_load_balance,
            help="how a request picks a data parallel core: the one caching the longest "
            "prefix of its prompt (from the cores' KV cache events), round robin, or the "
            "one with the fewest unfinished requests",
        )
        group.add_argument(
            "--dp-load-margin",
            type=int,
            default=d.dp_load_margin,
            help="prefix routing skips a core with this many more unfinished requests "
            "than the least loaded core",
        )
        group.add_argument(
            "--max-engine-restarts",
            type=int,
            default=d.max_engine_restarts,
            help="times a crashed engine core is restarted, its requests resumed (0: never)",
        )
        group.add_argument(
            "--engine-restart-backoff-s",
            type=float,
            default=d.engine_restart_backoff_s,
            help="seconds before the first restart, doubled for each later one (max 30)",
        )
        group.add_argument(
            "--tensor-parallel-size",
            "-tp",
            type=int,
            default=d.tensor_parallel_size,
            help="worker processes that split every layer (torch.distributed: gloo on CPU, "
            "NCCL on CUDA)",
        )
        group.add_argument(
            "--kv-cache-dtype",
            choices=["auto", "float32", "bfloat16", "float16"],
            default=d.kv_cache_dtype,
            help="dtype of the KV cache (auto: the model's; bfloat16 for quantized weights); "
            "16 bits halve what decoding reads",
        )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """Build from a namespace; attributes it lacks keep their defaults."""
        kwargs: dict[str, Any] = {
            f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)
        }
        return cls(**kwargs)
