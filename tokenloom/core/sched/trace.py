"""The scheduler trace: arrivals, request shapes, each step's decision and its duration.

``--record-trace FILE`` makes the engine core write one; ``tokenloom
simulate`` replays it through the real ``Scheduler`` (``tokenloom.simulator``).
The file is JSON Lines, one record a line, told apart by ``type``:

- ``header``: the configuration the steps were scheduled under (``TraceConfig``)
  and the wall-clock time recording began; every other time is seconds after it.
- ``arrival``: a request reached the scheduler: when it arrived at the front
  end and at the scheduler (after how many steps), its prompt, priority,
  adapter and tenant (renamed ``t0``, ``t1``, ... in order of appearance).
- ``finish``: a request left the core (or recording stopped): every token
  the core generated for it, and how and after which step it finished.
- ``step``: one per ``schedule()`` call: the requests scheduled and their
  token counts, in scheduling order, the requests preempted, and the step's
  measured duration (schedule, forward pass and update).
- ``reset``: a prefix-cache reset between two steps.

Requests are named by ``index``, their order of arrival at the scheduler.
Token ids are anonymised: token ``i`` of a request becomes a hash of its
first ``i + 1`` tokens, so two requests share synthetic prefixes exactly where
they share real ones (all that prefix caching looks at), and the text cannot
be read back.

Recording happens around the scheduler, in the engine core, so a scheduler
that records nothing costs what it always did.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

import msgspec

from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.request import Request, RequestStatus

TRACE_VERSION = 1

FinishKind = Literal["stop", "length", "abort", "ignored", "unfinished"]
_FINISH_KINDS: dict[RequestStatus, FinishKind] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "ignored",
}

# The written file is flushed at least this often, so a killed server leaves a usable trace.
_FLUSH_INTERVAL_S = 1.0
_TOKEN_MASK = 0x7FFFFFFF
_ANON_SEED = 0x7472616365


class TraceConfig(msgspec.Struct, kw_only=True):
    """What the scheduler's decisions depend on: its config, the KV cache's shape,
    the context length and the limits the engine set."""

    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int
    policy: str
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    max_model_len: int
    num_speculative_tokens: int = 0
    max_loras: int = 0

    @classmethod
    def of(
        cls,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        num_speculative_tokens: int = 0,
        max_loras: int = 0,
    ) -> TraceConfig:
        assert cache_config.num_blocks is not None
        return cls(
            max_num_seqs=scheduler_config.max_num_seqs,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            enable_chunked_prefill=scheduler_config.enable_chunked_prefill,
            long_prefill_token_threshold=scheduler_config.long_prefill_token_threshold,
            policy=scheduler_config.policy,
            block_size=cache_config.block_size,
            num_blocks=cache_config.num_blocks,
            enable_prefix_caching=cache_config.enable_prefix_caching,
            max_model_len=max_model_len,
            num_speculative_tokens=num_speculative_tokens,
            max_loras=max_loras,
        )

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            policy=self.policy,  # type: ignore[arg-type]
        )

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
        )


class TraceHeader(msgspec.Struct, tag="header", kw_only=True):
    version: int
    start_time: float  # time.time() when recording began
    config: TraceConfig


class TraceArrival(msgspec.Struct, tag="arrival", kw_only=True):
    """A request handed to the scheduler after ``add_step`` steps had run.

    ``prompt`` is anonymised; a crash-recovered request brings the output an
    earlier core generated as ``prior_output`` (anonymised after the prompt).
    """

    index: int
    request_id: str
    arrival_time: float
    add_time: float
    add_step: int
    prompt: list[int]
    prior_output: list[int] = msgspec.field(default_factory=list)
    priority: int = 0
    lora_int_id: int = 0
    structured: bool = False
    # Images in the prompt: their encoder work shapes the steps, and a trace keeps none of it.
    images: int = 0
    # The fair policy's tenant, named by order of first appearance ("t0", "t1", ...;
    # "" for none), and its weight.
    tenant: str = ""
    tenant_weight: float = 1.0


class TraceFinish(msgspec.Struct, tag="finish", kw_only=True):
    """How request ``index`` ended; ``output``: every token the core generated for
    it after its prior output (anonymised, continuing the prompt's chain).

    ``step``: for ``stop``, ``length`` and ``ignored``, the step whose update
    finished it (-1: refused on arrival, before any step); for ``abort``, the
    steps run before the abort reached the scheduler; ``unfinished``: still in
    flight when recording stopped.
    """

    index: int
    output: list[int]
    finish: FinishKind
    time: float
    step: int


class TraceStep(msgspec.Struct, tag="step", kw_only=True):
    """One ``schedule()``: ``reqs[i]`` got ``tokens[i]`` tokens (scheduling order)."""

    index: int
    start: float
    duration: float
    reqs: list[int]
    tokens: list[int]
    preempted: list[int] = msgspec.field(default_factory=list)


class TraceReset(msgspec.Struct, tag="reset", kw_only=True):
    """``reset_prefix_cache`` called after ``step`` steps had run."""

    step: int
    reset_running_requests: bool
    done: bool


TraceRecord = TraceHeader | TraceArrival | TraceFinish | TraceStep | TraceReset

_decoder = msgspec.json.Decoder(TraceRecord)


def anonymize(token_ids: list[int]) -> list[int]:
    """Token ``i`` -> a 31-bit hash of ``token_ids[: i + 1]``: equal prefixes stay equal,
    different ones part at the first difference and never meet again."""
    chained = _ANON_SEED
    out = []
    for token in token_ids:
        chained = hash((chained, token))
        out.append(chained & _TOKEN_MASK)
    return out


def trace_path(path: str, engine_index: int, data_parallel_size: int) -> Path:
    """Where core ``engine_index`` writes: ``path`` itself, or with data parallelism
    ``trace.jsonl`` -> ``trace.dp0.jsonl``, ``trace.dp1.jsonl``, ..."""
    p = Path(path)
    if data_parallel_size <= 1:
        return p
    return p.with_name(f"{p.stem}.dp{engine_index}{p.suffix}")


class TraceRecorder:
    """Writes a scheduler trace while the engine core runs (see the module doc).

    The core calls ``add`` for each request it hands the scheduler, ``abort``
    for aborts, ``step`` after each step and ``reset`` after a prefix-cache
    reset; ``close`` finishes the requests still in flight and the file. A
    file already at ``path`` is moved to ``path.prev`` first, so a core
    restarted after a crash keeps the trace of the one that died.
    """

    def __init__(self, path: str | Path, config: TraceConfig) -> None:
        self.path = Path(path)
        try:
            if self.path.exists():
                # An earlier run's (or, after a crash, the dead core's) trace is kept.
                self.path.replace(self.path.with_name(self.path.name + ".prev"))
            self._file: IO[bytes] = self.path.open("wb")
        except OSError as exc:
            raise ValueError(f"record_trace: cannot write {path}: {exc.strerror}") from None
        self._encoder = msgspec.json.Encoder()
        self._start_wall = time.time()
        self._start = time.perf_counter()
        self._next_flush = self._start + _FLUSH_INTERVAL_S
        # Requests in the core: their index, prior output count, and the scheduler's
        # object (its tokens are read at finish).
        self._live: dict[str, tuple[int, int, Request]] = {}
        # Tenant names are the operator's: the trace keeps only which is which.
        self._tenants: dict[str, str] = {}
        self._num_requests = 0
        self._num_steps = 0
        self._write(TraceHeader(version=TRACE_VERSION, start_time=self._start_wall, config=config))

    def _write(self, record: TraceRecord) -> None:
        self._file.write(self._encoder.encode(record))
        self._file.write(b"\n")

    def add(self, request: Request) -> None:
        """``request`` was just handed to the scheduler."""
        index = self._num_requests
        self._num_requests += 1
        tokens = anonymize(request.all_token_ids)
        num_prompt = request.num_prompt_tokens
        self._write(
            TraceArrival(
                index=index,
                request_id=request.request_id,
                arrival_time=request.arrival_time - self._start_wall,
                add_time=time.perf_counter() - self._start,
                add_step=self._num_steps,
                prompt=tokens[:num_prompt],
                prior_output=tokens[num_prompt:],
                priority=request.priority,
                lora_int_id=request.lora_int_id,
                structured=request.sampling_params.structured_outputs is not None,
                images=len(request.mm_features or ()),
                tenant=self._tenant_label(request.tenant),
                tenant_weight=request.tenant_weight,
            )
        )
        self._live[request.request_id] = (index, len(tokens) - num_prompt, request)
        if request.status == RequestStatus.FINISHED_IGNORED:  # refused on arrival
            self._finish(request.request_id, self._num_steps - 1)

    def _tenant_label(self, tenant: str) -> str:
        if not tenant:
            return ""
        label = self._tenants.get(tenant)
        if label is None:
            label = self._tenants[tenant] = f"t{len(self._tenants)}"
        return label

    def abort(self, request_ids: list[str]) -> None:
        """``request_ids`` were just aborted in the scheduler."""
        for req_id in request_ids:
            self._finish(req_id, self._num_steps)

    def reset(self, reset_running_requests: bool, done: bool) -> None:
        self._write(
            TraceReset(
                step=self._num_steps, reset_running_requests=reset_running_requests, done=done
            )
        )

    def step(
        self,
        scheduler_output: SchedulerOutput,
        started: float,
        ended: float,
        finished_req_ids: set[str] | None,
    ) -> None:
        """One step that ran from ``started`` to ``ended`` (``time.perf_counter()``);
        ``finished_req_ids``: the requests its update finished (or reported)."""
        live = self._live
        num_scheduled = scheduler_output.num_scheduled_tokens
        preempted = scheduler_output.preempted_req_ids
        self._write(
            TraceStep(
                index=self._num_steps,
                start=started - self._start,
                duration=ended - started,
                reqs=[live[req_id][0] for req_id in num_scheduled],
                tokens=list(num_scheduled.values()),
                preempted=[live[r][0] for r in preempted if r in live],
            )
        )
        if finished_req_ids:
            for req_id in finished_req_ids:
                self._finish(req_id, self._num_steps)
        self._num_steps += 1
        if ended >= self._next_flush:
            self._next_flush = ended + _FLUSH_INTERVAL_S
            self._file.flush()

    def _finish(self, req_id: str, step: int) -> None:
        entry = self._live.pop(req_id, None)
        if entry is None:  # finished before (an abort after a stop), or never added
            return
        index, num_prior, request = entry
        tokens = anonymize(request.all_token_ids)
        num_known = request.num_prompt_tokens + num_prior  # sent with the arrival
        self._write(
            TraceFinish(
                index=index,
                output=tokens[num_known:],
                finish=_FINISH_KINDS.get(request.status, "unfinished"),
                time=time.perf_counter() - self._start,
                step=step,
            )
        )

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        """Finish the requests still in flight (as ``unfinished``) and close the file."""
        if self._file.closed:
            return
        for req_id in list(self._live):
            self._finish(req_id, self._num_steps)
        self._file.close()


@dataclass
class Trace:
    """A trace read back: its header, arrivals by index, how each request ended,
    steps in order, prefix-cache resets."""

    header: TraceHeader
    arrivals: list[TraceArrival]
    finishes: dict[int, TraceFinish]
    steps: list[TraceStep]
    resets: list[TraceReset]

    @property
    def config(self) -> TraceConfig:
        return self.header.config

    def finish_of(self, index: int) -> TraceFinish:
        """How request ``index`` ended; a file cut short (a killed server) leaves the
        requests then in flight ``unfinished``, with no known output."""
        finish = self.finishes.get(index)
        if finish is None:
            finish = TraceFinish(index=index, output=[], finish="unfinished", time=0.0, step=-1)
        return finish


def read_trace(path: str | Path) -> Trace:
    """Read a trace written by ``TraceRecorder``; ``ValueError`` naming the file (and
    line) when it is not one."""
    header: TraceHeader | None = None
    arrivals: list[TraceArrival] = []
    finishes: dict[int, TraceFinish] = {}
    steps: list[TraceStep] = []
    resets: list[TraceReset] = []
    try:
        f = Path(path).open("rb")
    except OSError as exc:
        raise ValueError(f"cannot read the trace {path}: {exc.strerror}") from None
    with f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = _decoder.decode(line)
            except msgspec.DecodeError as exc:
                if header is None:
                    raise ValueError(f"{path} is not a tokenloom scheduler trace: {exc}") from None
                raise ValueError(f"{path}, line {number}: {exc}") from None
            if isinstance(record, TraceHeader):
                if header is not None:
                    raise ValueError(f"{path}, line {number}: a second header")
                if record.version != TRACE_VERSION:
                    raise ValueError(
                        f"{path}: trace version {record.version}, this tokenloom reads "
                        f"version {TRACE_VERSION}"
                    )
                header = record
            elif header is None:
                raise ValueError(f"{path} is not a tokenloom scheduler trace: no header first")
            elif isinstance(record, TraceArrival):
                if record.index != len(arrivals):
                    raise ValueError(f"{path}, line {number}: arrival {record.index} out of order")
                arrivals.append(record)
            elif isinstance(record, TraceFinish):
                finishes[record.index] = record
            elif isinstance(record, TraceStep):
                steps.append(record)
            else:
                resets.append(record)
    if header is None:
        raise ValueError(f"{path} is empty: no trace header")
    return Trace(header, arrivals, finishes, steps, resets)
