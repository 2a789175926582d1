"""A request as the scheduler sees it: token ids, progress and status."""

from __future__ import annotations

import enum
import sys
import time

from tokenloom.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    """Why a request ended, as reported to clients (OpenAI's finish_reason)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Every value above PREEMPTED is a finished state."""

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


# One shared screen per EOS id for requests without stop tokens (the common
# case), so ~1000 running requests read one hot set instead of 1000 cold ones.
_EOS_SCREENS: dict[int, frozenset[int]] = {}
_EMPTY_SCREEN: frozenset[int] = frozenset()


def _stop_screen(stop_token_ids: frozenset[int], eos_token_id: int | None) -> frozenset[int]:
    if stop_token_ids:
        return stop_token_ids if eos_token_id is None else stop_token_ids | {eos_token_id}
    if eos_token_id is None:
        return _EMPTY_SCREEN
    screen = _EOS_SCREENS.get(eos_token_id)
    if screen is None:
        screen = _EOS_SCREENS[eos_token_id] = frozenset((eos_token_id,))
    return screen


class Request:
    """One sequence being generated.

    ``num_computed_tokens`` counts tokens whose KV is (or is being, this step)
    written to the cache; the scheduler advances it when it schedules tokens.
    ``spec_token_ids`` holds draft tokens proposed for the next step.
    Slotted: the scheduler reads several attributes of every running request
    every step, and compact objects keep that walk in fewer cache lines.
    """

    __slots__ = (
        "request_id", "status", "num_tokens", "num_computed_tokens", "kv_noop_end",
        "spec_token_ids", "output_token_ids", "all_token_ids", "stop_screen", "length_end",
        "client_index", "num_cached_tokens", "sampling_params", "eos_token_id",
        "arrival_time", "priority", "cache_salt", "stop_reason", "prompt_token_ids",
        "num_prompt_tokens", "num_preemptions", "max_tokens", "stop_token_ids", "block_hashes",
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
        cache_salt: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        max_tokens = sampling_params.max_tokens
        stop_token_ids = frozenset(sampling_params.stop_token_ids or ())
        prompt_token_ids = list(prompt_token_ids)

        # The attributes the scheduler touches for every running request every
        # step come first: instance values are stored in assignment order, so
        # they share a couple of cache lines (this matters with ~1000 requests).
        self.request_id = request_id
        self.status = RequestStatus.WAITING
        # Prompt + output tokens (a plain attribute, read every step).
        self.num_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        # Set by the KV cache manager: allocate_slots(request, n) without lookahead
        # is a no-op (no new block, no block fills) while
        # num_computed_tokens + n < kv_noop_end; 0 while the request holds no blocks.
        self.kv_noop_end = 0
        self.spec_token_ids: list[int] = []
        # Plain attributes (not properties): the scheduler appends to both for
        # every decoding request every step.
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        # A cheap screen the scheduler applies to each decoded token before the
        # exact stop check: a token outside ``stop_screen`` with ``num_tokens``
        # below ``length_end`` cannot stop the request (max_model_len aside).
        self.stop_screen = _stop_screen(
            stop_token_ids, None if sampling_params.ignore_eos else eos_token_id
        )
        self.length_end = sys.maxsize if max_tokens is None else len(prompt_token_ids) + max_tokens
        self.client_index = client_index
        self.num_cached_tokens = -1

        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        # Separates prefix caches: requests with different salts never share blocks.
        self.cache_salt = cache_salt
        self.stop_reason: int | str | None = None
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_preemptions = 0
        self.max_tokens = max_tokens if max_tokens is not None else sys.maxsize
        self.stop_token_ids = stop_token_ids
        # Hashes of the full blocks of all_token_ids, extended by the KV cache
        # manager as tokens arrive; they survive preemption.
        self.block_hashes: list[object] = []

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self.append_output_token_id(token_ids)
            return
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        self.num_tokens += len(token_ids)

    def append_output_token_id(self, token_id: int) -> None:
        """One decoded token: the per-step hot path."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.num_tokens += 1

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
