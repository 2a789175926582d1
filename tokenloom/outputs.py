"""Data that crosses boundaries: runner -> scheduler -> engine -> user.

Typed dataclasses and msgspec Structs, so msgspec moves them between processes
without pickle. The per-step, per-request records the scheduler emits
(``EngineCoreOutput`` and what it holds) are Structs: building one costs a
third of a dataclass, and the scheduler builds one per running request per step.
"""

from __future__ import annotations

import array
import sys
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgspec

from tokenloom.request import FinishReason


class SpecDecodingStats(msgspec.Struct):
    """Counts for one step (deltas): ``num_drafts`` requests verified drafts,
    ``num_draft_tokens`` drafts in all, ``num_accepted_tokens`` of them kept;
    ``num_accepted_tokens_per_pos[i]``: requests whose draft at position ``i``
    (0-based) was accepted."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)

    @classmethod
    def new(cls, num_spec_tokens: int) -> SpecDecodingStats:
        return cls(num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        for i in range(min(num_accepted_tokens, len(per_pos))):
            per_pos[i] += 1


class TokenLogprobs(msgspec.Struct):
    """Logprobs at one generated position.

    ``token_ids[0]``/``logprobs[0]`` are the sampled token; the rest are the
    top-k alternatives in descending order.
    """

    token_ids: list[int]
    logprobs: list[float]


class KVTransferStats(msgspec.Struct):
    """What a KV connector did since the previous snapshot (deltas; see ``kv_transfer``).

    The scheduler side counts the external store's lookups: ``num_queried_tokens``
    (tokens of admitted requests looked up beyond the in-memory prefix hit),
    ``num_hit_tokens`` (of them, tokens loaded instead of computed) and
    ``num_recomputed_tokens`` (tokens that failed to load and were computed).
    The worker side counts the bytes moved (``num_bytes``) and the ``seconds`` of each transfer,
    per op (``load``/``save`` for the disk tier, ``recv``/``send`` between
    engines), and ``errors`` by reason. ``tier_bytes``: the disk tier's size
    now (None: no disk tier).
    """

    num_queried_tokens: int = 0
    num_hit_tokens: int = 0
    num_recomputed_tokens: int = 0
    num_bytes: dict[str, int] = msgspec.field(default_factory=dict)
    seconds: dict[str, list[float]] = msgspec.field(default_factory=dict)
    errors: dict[str, int] = msgspec.field(default_factory=dict)
    tier_bytes: int | None = None

    def merge(self, other: KVTransferStats) -> None:
        """Add ``other``'s counts to these (its ``tier_bytes`` wins when set)."""
        self.num_queried_tokens += other.num_queried_tokens
        self.num_hit_tokens += other.num_hit_tokens
        self.num_recomputed_tokens += other.num_recomputed_tokens
        for op, count in other.num_bytes.items():
            self.num_bytes[op] = self.num_bytes.get(op, 0) + count
        for op, seconds in other.seconds.items():
            self.seconds.setdefault(op, []).extend(seconds)
        for reason, count in other.errors.items():
            self.errors[reason] = self.errors.get(reason, 0) + count
        if other.tier_bytes is not None:
            self.tier_bytes = other.tier_bytes


@dataclass
class KVConnectorOutput:
    """What the worker side of a KV connector reports after a step (vLLM's fields).

    ``finished_recving``: requests whose asynchronous load ended (blocks that
    failed are in ``invalid_block_ids``); ``finished_sending``: finished
    requests whose blocks the connector held (``request_finished`` delayed
    their free) and that may be freed now; ``invalid_block_ids``: blocks that
    failed to load, which hold no valid KV and are recomputed.
    ``kv_connector_worker_meta``: what the worker side tells its own scheduler
    side (e.g. which blocks reached the disk tier).
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    kv_connector_stats: KVTransferStats | None = None
    kv_connector_worker_meta: Any = None


@dataclass
class ModelRunnerOutput:
    """What one forward pass produced, indexed like ``req_ids``.

    ``sampled_token_ids[i]`` is empty for a partial prefill; with speculative
    decoding it holds the accepted drafts plus one bonus token.
    ``logprobs[i]`` has one entry per sampled token when the request asked.
    ``req_id_to_index`` maps each id to its position in ``req_ids``.
    ``kv_connector_output``: the KV connector's report (None without one).
    ``pooler_output`` (a pooling runner only; None otherwise): for each request,
    its pooled vector as little-endian float32 bytes in the step that computed
    its last prompt token, else None.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None] | None = None
    kv_connector_output: KVConnectorOutput | None = None
    pooler_output: list[bytes | None] | None = None


class StepStats(msgspec.Struct):
    """What one engine step ran and how long it took (the dashboard's batch view).

    Tokens are split by kind: a running request's single new token is a
    decode token, drafts verified with it are draft tokens, everything else
    (prompt chunks, recomputation after a preemption) is prefill.
    ``preempted_req_ids``: requests this step preempted.
    """

    index: int
    timestamp: float  # time.time() at the end of the step
    duration_s: float  # schedule, execute and update
    num_reqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_draft_tokens: int
    preempted_req_ids: list[str] = msgspec.field(default_factory=list)


class SchedulerStats(msgspec.Struct):
    """A snapshot taken each step, turned into Prometheus metrics elsewhere.

    The prefix-cache and preemption figures count what happened since the
    previous snapshot (tokens for the cache), so consumers add them up.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # Draft verification counts of the steps since the previous snapshot (None: no drafts).
    spec_decoding_stats: SpecDecodingStats | None = None
    # Structured outputs, since the previous snapshot: requests added, grammars
    # compiled (seconds each) and requests that reused a cached grammar.
    num_structured_requests: int = 0
    grammar_compile_times: list[float] = msgspec.field(default_factory=list)
    grammar_cache_hits: int = 0
    # The engine core's step that produced this snapshot (None: no step ran).
    step: StepStats | None = None
    # A map of the KV cache, one byte per usable block (``KV_BLOCK_*``), sent
    # a few times a second at most (None in the other snapshots).
    kv_block_map: bytes | None = None
    # The KV connector's counts since the previous snapshot (None: no connector).
    kv_transfer_stats: KVTransferStats | None = None


# States of a block in ``SchedulerStats.kv_block_map``.
KV_BLOCK_FREE = 0  # free, holding nothing reusable
KV_BLOCK_CACHED = 1  # free, but its prefix can still be hit until it is reused
KV_BLOCK_USED = 2  # held by one request
KV_BLOCK_SHARED = 3  # held by several requests (a shared prefix)


class EngineCoreOutput(msgspec.Struct, omit_defaults=True):
    """New tokens of one request from one step, or a pooling request's pooled vector
    (``pooling_output``: little-endian float32 bytes, with its finish).

    Fields at their defaults are left out of the encoding: most of a decode
    step's outputs carry one token and nothing else."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_logprobs: list[TokenLogprobs] | None = None
    # Set on a finished request's output by a KV connector (vLLM's field).
    kv_transfer_params: dict[str, Any] | None = None
    pooling_output: bytes | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct):
    """Everything one step produced for one client.

    ``finished_requests``: ids of the client's requests that finished since the
    previous step's outputs (any reason, aborts included); None when none did.
    """

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    finished_requests: set[str] | None = None


@dataclass
class CompletionOutput:
    """One completion of a prompt (there are ``n`` of them)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # One dict per generated token: token id -> logprob (sampled token and top-k).
    logprobs: list[dict[int, float]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns for one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    # What a KV connector returned for the request (prefill/decode disaggregation).
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class PoolingOutput:
    """A pooled vector of one prompt: ``raw`` holds it as little-endian float32 bytes
    (as the engine sends it, what a base64 response carries), ``data`` as floats."""

    raw: bytes

    @property
    def data(self) -> list[float]:
        return float32_values(self.raw)


@dataclass
class EmbeddingOutput:
    """One prompt's embedding."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


OutputT = TypeVar("OutputT")


@dataclass
class PoolingRequestOutput(Generic[OutputT]):
    """What a pooling request returns (vLLM's shape): ``outputs`` is a ``PoolingOutput``
    from the engine, an ``EmbeddingOutput`` from ``LLM.embed``."""

    request_id: str
    outputs: OutputT
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """What ``LLM.embed`` returns for one prompt: ``outputs.embedding``."""

    @classmethod
    def from_base(cls, output: PoolingRequestOutput[PoolingOutput]) -> EmbeddingRequestOutput:
        return cls(
            request_id=output.request_id,
            outputs=EmbeddingOutput(output.outputs.data),
            prompt_token_ids=output.prompt_token_ids,
            finished=output.finished,
            num_cached_tokens=output.num_cached_tokens,
        )


def float32_values(raw: bytes) -> list[float]:
    """The values of little-endian float32 bytes (a pooled vector) as Python floats."""
    values = array.array("f", raw)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()
