"""A request as the scheduler sees it: token ids, progress and status."""

from __future__ import annotations

import enum
import logging
import sys
import time
from typing import TYPE_CHECKING

from tokenloom.lora_request import LoRARequest
from tokenloom.multimodal.inputs import MultiModalFeatureSpec, check_features
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenloom.structured_output.manager import StructuredOutputRequest

logger = logging.getLogger(__name__)


class FinishReason(str, enum.Enum):
    """Why a request ended, as reported to clients (OpenAI's finish_reason)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Every value above PREEMPTED is a finished state.

    ``WAITING_FOR_FSM``: waiting while its grammar compiles (structured
    outputs); the scheduler skips it until the grammar is ready, then it is
    ``WAITING``. ``WAITING_FOR_REMOTE_KVS``: waiting, with its blocks, while a
    KV connector loads its prefix (``tokenloom.kv_transfer``). Both come first
    so the other values keep their numbers.
    """

    WAITING_FOR_REMOTE_KVS = -1
    WAITING_FOR_FSM = 0
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    # A request refused before it ran (e.g. a prompt longer than the context).
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
}


# One shared set per EOS id for requests without stop token ids (the common
# case), so ~1000 running requests read one hot set instead of 1000 cold ones.
_EOS_ONLY: dict[int, frozenset[int]] = {}
_NO_STOPS: frozenset[int] = frozenset()

_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED


def stopping_token_ids(sampling_params: SamplingParams, eos_token_id: int | None) -> frozenset[int]:
    """The token ids that stop a request: its EOS unless ``ignore_eos``, plus ``stop_token_ids``.

    The one definition: the scheduler finishes a request on these
    (:meth:`Request.append_output_token_ids`), and the model runner bans exactly
    these while fewer than ``min_tokens`` outputs exist. Either way a stop token
    counts only as output number ``min_tokens + 1`` or later.
    """
    stop_ids = sampling_params.stop_token_ids
    eos = None if sampling_params.ignore_eos else eos_token_id
    if stop_ids:
        return frozenset(stop_ids) if eos is None else frozenset((*stop_ids, eos))
    if eos is None:
        return _NO_STOPS
    shared = _EOS_ONLY.get(eos)
    if shared is None:
        shared = _EOS_ONLY[eos] = frozenset((eos,))
    return shared


class Request:
    """One sequence being generated.

    ``num_computed_tokens`` counts tokens whose KV is (or is being, this step)
    written to the cache; the scheduler advances it when it schedules tokens.
    ``spec_token_ids`` holds draft tokens proposed for the next step.
    ``stopping_token_ids`` is :func:`stopping_token_ids` of the request.
    Output tokens join only through :meth:`append_output_token_ids`, which also
    decides when the request finishes.

    Slotted: the scheduler reads several attributes of every running request
    every step, and compact objects keep that walk in fewer cache lines.
    """

    __slots__ = (
        "request_id", "status", "num_computed_tokens", "spec_token_ids", "all_token_ids",
        "num_output_placeholders", "tenant",
        "output_token_ids", "stopping_token_ids", "_open_below", "_open_for", "client_index",
        "num_cached_tokens", "sampling_params", "eos_token_id", "arrival_time", "priority",
        "stop_reason", "prompt_token_ids", "num_prompt_tokens", "num_preemptions", "max_tokens",
        "min_tokens", "block_hashes", "lora_request", "lora_int_id", "structured_output_request",
        "mm_features", "mm_end", "tenant_weight", "kv_transfer_params", "pooling_params",
    )  # fmt: skip

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        client_index: int = 0,
        lora_request: LoRARequest | None = None,
        prior_output_token_ids: list[int] | None = None,
        mm_features: list[MultiModalFeatureSpec] | None = None,
        tenant: str = "",
        tenant_weight: float = 1.0,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        """``prior_output_token_ids``: output a crashed engine core already produced
        (a resumed request); they count as output for every limit and penalty.
        ``mm_features``: the prompt's images, in prompt order (see
        ``tokenloom.multimodal.inputs``). ``tenant`` names who sent it ("": the
        default tenant) and ``tenant_weight`` that tenant's share of the engine
        under the fair policy. ``pooling_params``: a pooling request, which
        finishes with the pooled output of its prompt (``sampling_params`` then goes
        unused)."""
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if not tenant_weight > 0 or tenant_weight == float("inf"):
            raise ValueError(f"tenant_weight must be a finite number > 0, got {tenant_weight!r}")
        max_tokens = sampling_params.max_tokens
        prompt_token_ids = list(prompt_token_ids)

        # The attributes the scheduler touches for every running request every
        # step come first: instance values are stored in slot order, so they
        # share a couple of cache lines (this matters with ~1000 requests).
        self.request_id = request_id
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.spec_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        # Async scheduling: tokens sampled by steps still running, not yet appended.
        self.num_output_placeholders = 0
        # Read by the fair policy for every scheduled request: it sits with the hot ones.
        self.tenant = tenant
        self.output_token_ids: list[int] = []
        if prior_output_token_ids:
            self.output_token_ids.extend(prior_output_token_ids)
            self.all_token_ids.extend(prior_output_token_ids)
        self.stopping_token_ids = stopping_token_ids(sampling_params, eos_token_id)
        # While len(output_token_ids) < _open_below, one more token reaches neither
        # max_tokens nor max_model_len (= _open_for): a constant the slow path of
        # append_output_token_ids computes for the max_model_len it is given.
        # (Output counts are mostly small cached ints; total lengths would be new
        # int objects each step.)
        self._open_below = 0
        self._open_for = 0
        self.client_index = client_index
        self.num_cached_tokens = -1

        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.stop_reason: int | str | None = None
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_preemptions = 0
        self.max_tokens = max_tokens if max_tokens is not None else sys.maxsize
        self.min_tokens = sampling_params.min_tokens
        # Hashes of the full blocks of all_token_ids, extended by the KV cache
        # manager as tokens arrive; they survive preemption.
        self.block_hashes: list[object] = []
        # The LoRA adapter it runs with; its id keys its cached blocks (0: base model).
        self.lora_request = lora_request
        self.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0
        # The grammar of a structured request (set by the scheduler), else None.
        self.structured_output_request: StructuredOutputRequest | None = None
        # Encoder inputs (images), and the prompt position after the last one: once
        # num_computed_tokens reaches mm_end the request needs no encoder work (0: none).
        self.mm_features: list[MultiModalFeatureSpec] | None = None
        self.mm_end = 0
        if mm_features:
            self.mm_features = check_features(mm_features, len(prompt_token_ids))
            self.mm_end = self.mm_features[-1].mm_position.end
        self.tenant_weight = tenant_weight
        # For a KV connector (vLLM's field): e.g. where a remote prefill left its KV.
        extra = sampling_params.extra_args
        self.kv_transfer_params: dict | None = (
            extra.get("kv_transfer_params") if extra is not None else None
        )
        self.pooling_params = pooling_params

    def set_structured_output_request(self, structured: StructuredOutputRequest) -> None:
        """Constrain this request: every sampled token must then advance the grammar."""
        self.structured_output_request = structured

    @property
    def use_structured_output(self) -> bool:
        return self.structured_output_request is not None

    @property
    def has_encoder_inputs(self) -> bool:
        return self.mm_features is not None

    def get_num_encoder_tokens(self, input_id: int) -> int:
        """How many prompt positions (and encoder output rows) item ``input_id`` fills."""
        assert self.mm_features is not None
        return self.mm_features[input_id].mm_position.length

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int], max_model_len: int) -> list[int] | None:
        """Append sampled tokens up to and including the first one that finishes the request.

        The only way tokens join a request: one decoded token, or accepted
        drafts plus the bonus token. After each token: a token in
        ``stopping_token_ids``, once more than ``min_tokens`` outputs exist
        including it, finishes the request as ``FINISHED_STOPPED`` with
        ``stop_reason`` the token (None for EOS); reaching ``max_tokens``
        outputs or ``max_model_len`` tokens finishes it as
        ``FINISHED_LENGTH_CAPPED``. A stop token wins over a length cap reached
        by the same token.

        A structured request's grammar accepts each appended token; the
        grammar reaching its end finishes the request as ``FINISHED_STOPPED``
        (also when the end is a token it would otherwise not stop on, e.g.
        EOS with ``ignore_eos``). A token the grammar refuses (the runner
        masks those, so only a bug gets here) is dropped and the request
        aborted.

        Reports the finish: None when the request runs on (every token was
        appended); when it finished, the tokens appended (``token_ids`` up to
        the finishing token; the rest is dropped), with ``status`` and
        ``stop_reason`` set.
        """
        if len(token_ids) == 1:
            # The decode step of almost every request: a token that neither
            # stops nor reaches a length cap is appended with nothing else.
            token = token_ids[0]
            output = self.output_token_ids
            if max_model_len == self._open_for and len(output) < self._open_below:
                if token not in self.stopping_token_ids:
                    output.append(token)
                    self.all_token_ids.append(token)
                    return None
        elif not token_ids:
            return None
        return self._append_until_finish(token_ids, max_model_len)

    def _append_until_finish(self, token_ids: list[int], max_model_len: int) -> list[int] | None:
        if max_model_len != self._open_for:
            self._open_for = max_model_len
            self._open_below = min(self.max_tokens, max_model_len - self.num_prompt_tokens) - 1
            if self.structured_output_request is not None:
                # Every token of a structured request comes here, to its grammar.
                self._open_below = 0
        num_out = len(self.output_token_ids)
        # Index of the first token that reaches a length cap (the first token at
        # the latest: a request always gets at least one).
        length_at = min(self.max_tokens - num_out, max_model_len - len(self.all_token_ids)) - 1
        if length_at < 0:
            length_at = 0
        status = None
        kept = len(token_ids)
        if length_at < kept:
            kept = length_at + 1
            status = _LENGTH
        stop_ids = self.stopping_token_ids
        if stop_ids:
            # Output number num_out + i + 1 may stop once it exceeds min_tokens.
            for i in range(max(self.min_tokens - num_out, 0), kept):
                token = token_ids[i]
                if token in stop_ids:
                    kept = i + 1
                    status = _STOPPED
                    params = self.sampling_params
                    is_eos = token == self.eos_token_id and not params.ignore_eos
                    self.stop_reason = None if is_eos else token
                    break
        if self.structured_output_request is not None:
            kept, status = self._advance_grammar(token_ids, kept, status)
        if kept < len(token_ids):
            token_ids = token_ids[:kept]
        self.all_token_ids.extend(token_ids)
        self.output_token_ids.extend(token_ids)
        if status is None:
            return None
        self.status = status
        return token_ids

    def _advance_grammar(
        self, token_ids: list[int], kept: int, status: RequestStatus | None
    ) -> tuple[int, RequestStatus | None]:
        """Feed ``token_ids[:kept]`` to the grammar; where the request ends, and how."""
        structured = self.structured_output_request
        assert structured is not None
        matcher = structured.grammar
        if matcher is None:  # not compiled: the scheduler never runs such a request
            raise RuntimeError(f"request {self.request_id} sampled before its grammar was ready")
        # A reasoning model's thinking is not the grammar's: it starts after it.
        first = (
            0
            if structured.reasoning.answering
            else structured.reasoning.answer_start(token_ids, kept)
        )
        for i in range(first, kept):
            if not matcher.accept_tokens(token_ids[i : i + 1]):
                logger.error(
                    "request %s: the grammar refused sampled token %d; aborting it",
                    self.request_id,
                    token_ids[i],
                )
                self.stop_reason = None
                return i, RequestStatus.FINISHED_ABORTED
            if matcher.is_terminated():
                if status is not _STOPPED or i + 1 < kept:
                    self.stop_reason = None
                return i + 1, _STOPPED
        return kept, status

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
