"""Turns engine core outputs (token ids) into ``RequestOutput``s for users.

One ``_SequenceState`` per core request holds its detokenizer, tokens and
logprobs; a ``_ParentState`` per user request gathers its ``n`` sequences
(child requests in the core) into one ``RequestOutput``. Outputs go to the
request's ``RequestOutputCollector`` (``AsyncLLM``) or, without one, are
returned once the request has finished (``LLM``). Stop strings are found
here, so the ids of requests they ended are handed back for aborting in the
core. Latencies for ``IterationStats`` are measured here too. A pooling
request (``EngineCoreRequest.pooling_params``) is one sequence that ends with
its pooled vector: its output is a ``PoolingRequestOutput``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from tokenloom.engine.detokenizer import IncrementalDetokenizer
from tokenloom.engine.messages import EngineCoreRequest
from tokenloom.engine.recovery import InFlight
from tokenloom.metrics.stats import FinishedRequestStats, IterationStats, RequestTimeline
from tokenloom.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    TokenLogprobs,
)
from tokenloom.request import FinishReason

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


OutputT = TypeVar("OutputT", RequestOutput, PoolingRequestOutput[PoolingOutput])
# What a request hands its consumer: a RequestOutput, or a pooling request's output.
AnyRequestOutput = RequestOutput | PoolingRequestOutput[PoolingOutput]


class RequestOutputCollector(Generic[OutputT]):
    """The latest output of one request, for one consumer.

    A slow consumer does not build a backlog: with ``delta`` outputs new pieces
    are merged into the waiting one; otherwise the newer output replaces it.
    """

    def __init__(self, delta: bool) -> None:
        self.delta = delta
        self._output: OutputT | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: OutputT) -> None:
        if self._output is None or not self.delta:
            self._output = output
        else:
            _merge_delta(cast(RequestOutput, self._output), cast(RequestOutput, output))
        self._ready.set()

    def put_error(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def get(self) -> OutputT:
        while self._output is None:
            if self._error is not None:
                raise self._error
            self._ready.clear()
            await self._ready.wait()
        output, self._output = self._output, None
        return output


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    by_index = {c.index: c for c in into.outputs}
    for completion in new.outputs:
        old = by_index.get(completion.index)
        if old is None:
            into.outputs.append(completion)
            by_index[completion.index] = completion
            continue
        old.text += completion.text
        old.token_ids.extend(completion.token_ids)
        if completion.logprobs is not None:
            old.logprobs = (old.logprobs or []) + completion.logprobs
        old.finish_reason = completion.finish_reason
        old.stop_reason = completion.stop_reason
    into.outputs.sort(key=lambda c: c.index)
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens
    if new.kv_transfer_params is not None:
        into.kv_transfer_params = new.kv_transfer_params


@dataclass
class OutputProcessorOutput:
    """Finished outputs with no collector (``LLM``), and core requests to abort."""

    request_outputs: list[AnyRequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)


class _SequenceState:
    """One completion: a request in the engine core."""

    def __init__(
        self,
        parent: _ParentState,
        index: int,
        request: EngineCoreRequest,
        tokenizer: PreTrainedTokenizerBase,
    ):
        params = request.sampling_params
        self.parent = parent
        self.index = index
        self.request = request  # resent, with the output so far, if its core dies
        self.request_id = request.request_id
        self.want_logprobs = params.logprobs is not None
        self.include_stop = params.include_stop_str_in_output
        self.detokenizer = IncrementalDetokenizer(
            tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,  # type: ignore[arg-type]
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        # A KV connector's params for this completion (set on its last output).
        self.kv_transfer_params: dict | None = None
        # A pooling request's vector, once its prompt is computed (little-endian float32).
        self.pooled: bytes | None = None
        # What earlier delta outputs already carried.
        self.sent_text = 0
        self.sent_tokens = 0
        # Timing, all time.time() seconds.
        self.arrival_time = request.arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time = 0.0
        self.preemption_times: list[float] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, output: EngineCoreOutput) -> bool:
        """Apply one core output; True when a stop string ended the sequence here."""
        if output.pooling_output is not None:
            self.pooled = output.pooling_output
        new_ids = output.new_token_ids
        self.token_ids.extend(new_ids)
        if self.want_logprobs and output.new_logprobs:
            self.logprobs.extend(_logprob_dict(lp) for lp in output.new_logprobs)
        self.num_cached_tokens = output.num_cached_tokens
        if output.kv_transfer_params is not None:
            self.kv_transfer_params = output.kv_transfer_params
        # An EOS or stop token id that ended the sequence is not part of its text.
        ended_by_token = output.finish_reason == FinishReason.STOP and new_ids
        text_ids = new_ids[:-1] if ended_by_token and not self.include_stop else new_ids
        stop_string = self.detokenizer.update(text_ids)
        if stop_string is not None:
            self.finish_reason, self.stop_reason = FinishReason.STOP, stop_string
            return not output.finished
        if output.finish_reason is not None:
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
        return False

    def completion(self, delta: bool) -> CompletionOutput:
        text = self.detokenizer.visible_text(self.finished)
        token_ids = self.token_ids
        logprobs: list[dict[int, float]] | None = self.logprobs if self.want_logprobs else None
        if delta:
            text = text[self.sent_text :]
            token_ids = token_ids[self.sent_tokens :]
            if logprobs is not None:
                logprobs = logprobs[self.sent_tokens :]
            self.sent_text += len(text)
            self.sent_tokens += len(token_ids)
        else:
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            finish_reason=None if self.finish_reason is None else self.finish_reason.value,
            stop_reason=self.stop_reason,
            logprobs=logprobs,
        )

    def timeline(self, finish_time: float | None = None) -> RequestTimeline:
        return RequestTimeline(
            request_id=self.request_id,
            arrival_time=self.arrival_time,
            first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time,
            finish_time=finish_time,
            preemption_times=list(self.preemption_times),
            num_prompt_tokens=len(self.parent.prompt_token_ids),
            num_generation_tokens=len(self.token_ids),
            num_cached_tokens=self.num_cached_tokens,
            finish_reason=None if self.finish_reason is None else self.finish_reason.value,
        )

    def finished_stats(self, now: float) -> FinishedRequestStats:
        first_scheduled = self.first_scheduled_time or self.arrival_time
        first_token = self.first_token_time or now
        return FinishedRequestStats(
            finish_reason=str(self.finish_reason),
            e2e_latency=now - self.arrival_time,
            queued_time=max(first_scheduled - self.arrival_time, 0.0),
            prefill_time=max(first_token - first_scheduled, 0.0),
            decode_time=max(now - first_token, 0.0),
            num_prompt_tokens=len(self.parent.prompt_token_ids),
            num_generation_tokens=len(self.token_ids),
            timeline=self.timeline(now),
            sampling_params=self.request.sampling_params,
            trace_headers=self.parent.trace_headers,
        )


def _logprob_dict(lp: TokenLogprobs) -> dict[int, float]:
    return dict(zip(lp.token_ids, lp.logprobs, strict=False))


class _ParentState:
    """One user request and its ``n`` sequences."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        collector: RequestOutputCollector[Any] | None,
        trace_headers: Mapping[str, str] | None = None,
        pooling: bool = False,
    ) -> None:
        self.request_id = request_id
        self.pooling = pooling
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.collector = collector
        self.trace_headers = trace_headers
        self.sequences: list[_SequenceState] = []

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def make_output(self, changed: Iterable[_SequenceState]) -> AnyRequestOutput:
        if self.pooling:
            (seq,) = self.sequences
            return PoolingRequestOutput(
                request_id=self.request_id,
                outputs=PoolingOutput(seq.pooled or b""),
                prompt_token_ids=self.prompt_token_ids,
                finished=self.finished,
                num_cached_tokens=seq.num_cached_tokens,
            )
        delta = self.collector is not None and self.collector.delta
        sequences = sorted(changed, key=lambda s: s.index) if delta else self.sequences
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.completion(delta) for s in sequences],
            finished=self.finished,
            num_cached_tokens=self.sequences[0].num_cached_tokens,
            kv_transfer_params=self.sequences[0].kv_transfer_params,
        )


class OutputProcessor:
    """Per-request output state for every request in flight."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._parents: dict[str, _ParentState] = {}
        self._sequences: dict[str, _SequenceState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents or request_id in self._sequences

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        child_requests: list[EngineCoreRequest],
        collector: RequestOutputCollector[Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> None:
        """Track a user request whose completions are ``child_requests`` (index order;
        a pooling request has one); ``trace_headers``: the W3C trace context it came
        with (request tracing)."""
        ids = [request_id] + [c.request_id for c in child_requests if c.request_id != request_id]
        taken = [i for i in ids if i in self]
        if taken:
            raise ValueError(f"request_id {taken[0]!r} is already in use")
        parent = _ParentState(
            request_id,
            prompt,
            child_requests[0].prompt_token_ids,
            collector=collector,
            trace_headers=trace_headers,
            pooling=child_requests[0].pooling_params is not None,
        )
        for index, child in enumerate(child_requests):
            state = _SequenceState(parent, index, child, self._tokenizer)
            parent.sequences.append(state)
            self._sequences[child.request_id] = state
        self._parents[request_id] = parent

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """End user requests with finish reason "abort"; return the core ids to abort.

        A consumer still waiting on the request's collector gets a last output.
        """
        core_ids: list[str] = []
        for request_id in request_ids:
            parent = self._parents.pop(request_id, None)
            if parent is None:
                continue
            aborted = [seq for seq in parent.sequences if not seq.finished]
            for seq in aborted:
                del self._sequences[seq.request_id]
                seq.finish_reason = FinishReason.ABORT
                core_ids.append(seq.request_id)
            if parent.collector is not None and aborted:
                parent.collector.put(parent.make_output(aborted))
        return core_ids

    def in_flight(self, core_request_ids: Collection[str] | None = None) -> list[InFlight]:
        """Unfinished sequences (those of ``core_request_ids`` only, if given), in arrival
        order, with the tokens streamed so far: what a dead core's successor must resume."""
        sequences = self._sequences
        if core_request_ids is not None:
            wanted = [sequences.get(i) for i in core_request_ids]
            found = [s for s in wanted if s is not None]
        else:
            found = list(sequences.values())
        return [InFlight(s.request, list(s.token_ids)) for s in found if not s.finished]

    def record_preemptions(self, core_request_ids: Iterable[str], now: float) -> None:
        """The engine core preempted these requests (their timelines show it)."""
        sequences = self._sequences
        for req_id in core_request_ids:
            seq = sequences.get(req_id)
            if seq is not None:
                seq.preemption_times.append(now)

    def propagate_error(self, error: BaseException) -> None:
        """The engine died: every waiting consumer gets ``error``."""
        for parent in self._parents.values():
            if parent.collector is not None:
                parent.collector.put_error(error)
        self._parents.clear()
        self._sequences.clear()

    def process_outputs(
        self,
        outputs: list[EngineCoreOutput],
        now: float,
        iteration_stats: IterationStats | None = None,
        first_scheduled_times: dict[str, float] | None = None,
    ) -> OutputProcessorOutput:
        """Apply one step's outputs; one ``RequestOutput`` per touched user request."""
        result = OutputProcessorOutput()
        touched: dict[str, list[_SequenceState]] = {}
        for output in outputs:
            seq = self._sequences.get(output.request_id)
            if seq is None or seq.finished:
                continue  # aborted, or already ended by a stop string
            if first_scheduled_times and output.request_id in first_scheduled_times:
                seq.first_scheduled_time = first_scheduled_times[output.request_id]
            if iteration_stats is not None:
                self._record_token_timing(seq, output, now, iteration_stats)
            if seq.update(output):
                result.reqs_to_abort.append(seq.request_id)
            if seq.finished:
                del self._sequences[seq.request_id]
                if iteration_stats is not None:
                    iteration_stats.finished_requests.append(seq.finished_stats(now))
            touched.setdefault(seq.parent.request_id, []).append(seq)

        for request_id, changed in touched.items():
            parent = self._parents[request_id]
            finished = parent.finished
            if parent.collector is not None:
                parent.collector.put(parent.make_output(changed))
            elif finished:
                result.request_outputs.append(parent.make_output(changed))
            if finished:
                del self._parents[request_id]
        return result

    @staticmethod
    def _record_token_timing(
        seq: _SequenceState, output: EngineCoreOutput, now: float, stats: IterationStats
    ) -> None:
        num_new = len(output.new_token_ids)
        if num_new == 0:
            if output.pooling_output is not None:  # a pooled prompt counts as prompt tokens
                stats.num_prompt_tokens += len(seq.parent.prompt_token_ids)
            return
        stats.num_generation_tokens += num_new
        if seq.first_token_time is None:
            seq.first_token_time = now
            stats.num_prompt_tokens += len(seq.parent.prompt_token_ids)
            stats.time_to_first_tokens_iter.append(now - seq.arrival_time)
            stats.started_requests.append(seq.timeline())
        else:
            stats.inter_token_latencies_iter.append(now - seq.last_token_time)
        seq.last_token_time = now
