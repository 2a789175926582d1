"""The continuous-batching scheduler.

There is no prefill or decode phase: each step every request gets the tokens
that bring ``num_computed_tokens`` up to ``num_tokens`` (plus draft tokens),
RUNNING requests first in admission order (arrival order under the fair
policy), then WAITING ones in queue order,
within one token budget (``max_num_batched_tokens``) and ``max_num_seqs``.
When the KV cache runs out while scheduling a running request, the
lowest-priority running request is preempted (its blocks are freed and it is
recomputed later); no waiting request is admitted in a step that preempted.

Safety net for requests that can never run: a prompt longer than
``max_model_len``, a request needing more blocks than the whole cache holds,
or (chunked prefill off) a prompt larger than ``max_num_batched_tokens`` is
finished as ``FINISHED_IGNORED`` instead of waiting forever, and so is a
preempted request that has since grown past those limits (it cannot be
recomputed; set ``max_num_batched_tokens >= max_model_len`` when chunking is
off to rule this out). The next
``update_from_output`` reports it with ``finish_reason=LENGTH`` and no tokens.
The frontend normally rejects such requests before they get here.

Other choices worth knowing:

* A waiting request that does not fit (chunking off, or no free blocks) stops
  admission for the step under both policies: nothing behind it overtakes it.
* ``long_prefill_token_threshold`` caps prefill chunks, so it only applies
  with chunked prefill on.
* Draft tokens are scheduled with the request (``num_scheduled_tokens``
  counts them) and get their KV slots as lookahead, so blocks holding
  unverified tokens are never cached; rejected drafts are rolled back in
  ``update_from_output``.
* ``SchedulerStats`` hold deltas, so each step's stats ride on one
  ``EngineCoreOutputs`` only (the lowest client index, client 0 when no
  request produced output), never duplicated across clients.
* ``EngineCoreOutputs.finished_requests`` lists the client's requests that
  finished since the previous ``update_from_output``: stopped, length-capped
  or ignored ones (whose final output is in the same object) and those ended
  through ``finish_requests`` (aborts); None when there are none.
* Sampled tokens join a request only through
  ``Request.append_output_token_ids``, which also decides when it finishes.
* Structured requests (``SamplingParams.structured_outputs``) wait as
  ``WAITING_FOR_FSM`` while their grammar compiles (in the
  ``StructuredOutputManager``'s pool) and are skipped by admission, keeping
  their place in the queue, until it is ready; a grammar that fails to
  compile finishes its request as aborted. ``get_grammar_bitmask`` gives the
  step's bitmask for the structured requests that sample in it; drafts of a
  structured request are cut at the first token its grammar refuses. A
  reasoning model's request (``reasoning_gate``) gets no row while it thinks.
* Pooling requests (``Request.pooling_params``) are scheduled like any
  prompt, chunked and batched with the others, and finish as
  ``FINISHED_STOPPED`` in the step whose runner output carries their pooled
  vector (``ModelRunnerOutput.pooler_output``, sent on in
  ``EngineCoreOutput.pooling_output``): they never decode. Those whose pooling
  reads every token skip prefix-cache hits (``skip_reading_prefix_cache``).
* Requests preempted by ``reset_prefix_cache(reset_running_requests=True)``
  are reported in the next ``preempted_req_ids``; that step admits nothing,
  so the runner drops them before they are resumed.
* Encoder inputs (``Request.mm_features``, images) are scheduled with the
  tokens that reach them (``encoder_inputs.py``): each step's
  ``scheduled_encoder_inputs`` within ``max_num_encoder_input_tokens``, the
  ``EncoderCacheManager`` sharing outputs between requests; a request
  releases an item once its computed tokens pass it, and everything it holds
  when it finishes or is preempted. An item larger than the encoder budget
  or cache makes its request unservable.
* The policy's queue (``request_queue.py``) orders admission and chooses
  preemption victims. Under the fair policy (``fair_share.py``) every
  scheduled token is charged to its request's tenant; while another tenant
  waits, a tenant's prefill chunks are capped at its weight's share of the
  step's budget; one waiting request per step may take the seat of a
  tenant holding more than its share of the batch (that tenant's latest
  request is preempted, in the same step, and not resumed in it); and the
  running list is kept in arrival order (so a step walks the requests
  roughly in the order they were made, as under FCFS; the policy picks its
  victims from its own books, not from the list's order).
* With a KV connector (``kv_connector``, see ``tokenloom.kv_transfer.base``)
  a waiting request may find more of its prefix in the connector's store:
  loaded asynchronously, it waits as ``WAITING_FOR_REMOTE_KVS`` with its
  blocks, skipped by admission (keeping its place) until the load ends. A
  finished request's blocks may stay held while the connector saves or sends
  them. ``connector_state.py`` keeps that bookkeeping.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from itertools import repeat
from typing import TYPE_CHECKING

from tokenloom.config import CacheConfig, LoRAConfig, SchedulerConfig
from tokenloom.core.encoder_cache_manager import EncoderCacheManager
from tokenloom.core.kv_cache.manager import KVCacheManager
from tokenloom.core.sched.connector_state import ConnectorState
from tokenloom.core.sched.encoder_inputs import (
    encoder_budgets,
    release_passed_encoder_inputs,
    schedule_encoder_inputs,
)
from tokenloom.core.sched.interface import SchedulerInterface
from tokenloom.core.sched.output import NewRequestData, SchedulerOutput
from tokenloom.core.sched.request_queue import (
    FairRequestQueue,
    RequestQueue,
    create_request_queue,
)
from tokenloom.core.sched.step_builder import StepBuilder
from tokenloom.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    SchedulerStats,
    SpecDecodingStats,
)
from tokenloom.request import FinishReason, Request, RequestStatus

if TYPE_CHECKING:
    from tokenloom.core.kv_cache.block import KVCacheBlocks
    from tokenloom.kv_transfer.base import KVConnectorBase
    from tokenloom.structured_output.manager import GrammarOutput, StructuredOutputManager

logger = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING
_WAITING_FOR_FSM = RequestStatus.WAITING_FOR_FSM
_PREEMPTED = RequestStatus.PREEMPTED
_WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS


class Scheduler(SchedulerInterface):
    """Iteration-level scheduler over a paged KV cache with prefix caching."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        num_speculative_tokens: int = 0,
        log_stats: bool = False,
        lora_config: LoRAConfig | None = None,
        structured_output_manager: StructuredOutputManager | None = None,
        max_tokens_per_mm_item: int = 0,
        kv_connector: KVConnectorBase | None = None,
    ) -> None:
        """``lora_config``: at most ``max_loras`` distinct LoRA adapters among the
        running requests (so in any step); a waiting request whose adapter would
        exceed that waits, and requests behind it may go first (vLLM's rule).
        ``max_tokens_per_mm_item``: the most placeholder tokens one image of the
        model can have (0: text only); the encoder budgets are raised to it.
        ``kv_connector``: the scheduler side of a KV connector, or None."""
        if cache_config.num_blocks is None:
            raise ValueError(
                "num_blocks must be set in CacheConfig before building the Scheduler "
                "(the engine sizes the KV cache first)"
            )
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        self.scheduler_config = scheduler_config
        self._async_scheduling = scheduler_config.async_scheduling
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        self.log_stats = log_stats
        # Compiles grammars and builds bitmasks; None: structured requests are refused.
        self.structured_output_manager = structured_output_manager
        # Structured requests in ``requests`` (0: the step needs no bitmask at all).
        self._num_structured = 0

        self.kv_cache_manager = KVCacheManager(
            num_blocks=cache_config.num_blocks,
            block_size=cache_config.block_size,
            max_model_len=max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
        )
        self.block_size = cache_config.block_size
        # Every block a single request could ever hold (the null block excluded).
        self._capacity_blocks = self.kv_cache_manager.num_free_blocks

        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = create_request_queue(
            scheduler_config.policy,
            priority_aging_s=scheduler_config.priority_aging_s,
            fair_burst_tokens=scheduler_config.fair_burst_tokens,
        )
        # The fair policy's accounts (None under the other policies).
        self._fair = self.waiting.fair if isinstance(self.waiting, FairRequestQueue) else None
        self.running: list[Request] = []
        # Ids finished since the last SchedulerOutput (sent so the runner drops them).
        self.finished_req_ids: set[str] = set()
        # Requests finished as FINISHED_IGNORED, reported by the next update_from_output.
        self._ignored: list[Request] = []
        # (client_index, request_id) of requests ended by finish_requests since the
        # last update_from_output, for EngineCoreOutputs.finished_requests.
        self._finished_outside: list[tuple[int, str]] = []
        # Running requests preempted outside schedule() (reset_prefix_cache).
        self._preempted_outside: set[str] = set()

        chunked = scheduler_config.enable_chunked_prefill
        threshold = scheduler_config.long_prefill_token_threshold
        # The threshold caps prefill chunks, so it only applies when chunking is on.
        self._chunk_cap = threshold if (chunked and threshold > 0) else sys.maxsize

        # Drafts only arrive through update_draft_token_ids; until the first ones do,
        # the per-request loops skip reading spec_token_ids (one less object touched
        # per request per step, which counts at large batch sizes).
        self._drafts_seen = False

        # Counted since the previous make_stats().
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._num_preemptions = 0
        self._max_loras = lora_config.max_loras if lora_config is not None else 0
        self._spec_stats: SpecDecodingStats | None = None

        # Encoder inputs: the per-step compute budget and the shared output cache.
        self._encoder_budget, cache_size = encoder_budgets(scheduler_config, max_tokens_per_mm_item)
        self.encoder_cache_manager = EncoderCacheManager(
            cache_size, share=scheduler_config.enable_encoder_cache
        )
        self._max_encoder_item = min(self._encoder_budget, cache_size)
        # Like _drafts_seen: until a request with images arrives, the running loop's
        # fast path skips reading mm_end.
        self._mm_seen = False

        self.connector = kv_connector
        self._kv = ConnectorState(kv_connector, self.kv_cache_manager) if kv_connector else None

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already scheduled")
        structured = request.sampling_params.structured_outputs
        if structured is not None:
            if self.structured_output_manager is None:
                raise ValueError(
                    "structured_outputs needs a scheduler with a StructuredOutputManager"
                )
        if self._unservable(request):
            self._ignore(request)
            return
        if request.mm_features:
            self._mm_seen = True
        if structured is not None:
            assert self.structured_output_manager is not None
            request.set_structured_output_request(
                self.structured_output_manager.grammar_init(structured)
            )
            request.status = RequestStatus.WAITING_FOR_FSM
            self._num_structured += 1
        self.requests[request.request_id] = request
        if self._fair is not None:
            self._fair.join(request)
        self.waiting.add(request)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a finished status, got {finished_status!r}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        running_gone: set[Request] = set()
        waiting_gone: list[Request] = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            self._forget(req_id, request.status == _RUNNING)
            if request.status == _RUNNING:
                running_gone.add(request)
            else:
                waiting_gone.append(request)
            if request.mm_features:
                self.encoder_cache_manager.free(request)
            request.status = finished_status
            # A waiting request holds blocks after (or during) a KV connector's load.
            if self._kv is not None:
                self._kv.finish(request)
            else:
                self.kv_cache_manager.free(request)
            request.spec_token_ids = []
            self.finished_req_ids.add(req_id)
            self._finished_outside.append((request.client_index, req_id))
        if running_gone:
            self.running = [r for r in self.running if r not in running_gone]
        if waiting_gone:
            self.waiting.remove(waiting_gone)

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Drafts for running requests, verified next step (truncated to num_speculative_tokens)."""
        limit = self.num_speculative_tokens or sys.maxsize
        requests = self.requests
        for req_id, drafts in draft_token_ids.items():
            request = requests.get(req_id)
            if request is None or request.status != _RUNNING:
                continue
            drafts = list(drafts[:limit])
            structured = request.structured_output_request
            if drafts and structured is not None and structured.grammar is not None:
                if structured.reasoning.answering:
                    drafts = structured.grammar.validate_tokens(drafts)
                else:
                    drafts = structured.reasoning.draft_limit(drafts)
            request.spec_token_ids = drafts
            if drafts:
                self._drafts_seen = True

    def get_request_counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    def has_finished_requests(self) -> bool:
        return bool(self.finished_req_ids) or bool(self._ignored)

    def has_requests(self) -> bool:
        """Also true while a KV connector still moves blocks: the engine keeps stepping."""
        if self._kv is not None and self._kv.has_pending():
            return True
        return super().has_requests()

    def get_kv_connector(self) -> KVConnectorBase | None:
        return self.connector

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        fair = self._fair
        if fair is None:
            return self._schedule(False)
        fair.steps_since_express += 1
        return self._schedule(len(fair.active) > 1)

    def _schedule(self, may_express: bool) -> SchedulerOutput:
        """One step. ``may_express``: the fair policy may give the step to tenants
        behind their share that have just sent requests (``FairShare.express_tenants``)."""
        step = StepBuilder(self.scheduler_config.max_num_batched_tokens, self._encoder_budget)
        chunk_cap = self._chunk_cap
        max_model_len = self.max_model_len
        manager = self.kv_cache_manager
        allocate = manager.allocate_slots
        # Every running request holds blocks, so the manager knows its bound.
        next_allocation_at = manager.next_allocation_at
        running = self.running
        preempted_ids: set[str] = self._preempted_outside
        self._preempted_outside = set()

        # The hot loop inlines step.add_running (no new blocks): the budget is a
        # local, stored back before any call into the builder. (``lst.append(x)``
        # beats a bound ``append`` in a local: CPython specialises the former.)
        num_scheduled = step.num_scheduled
        num_computed_column = step.num_computed
        token_budget = step.token_budget
        fast_cap = min(chunk_cap, token_budget)
        no_drafts = not self._drafts_seen
        no_mm = not self._mm_seen
        # Requests whose encoder inputs were looked at this step (they release the
        # items their computed tokens pass once the step is decided), and items whose
        # encoding was scheduled and then taken back with a preempted request.
        mm_scheduled: list[Request] = []
        orphans: list[str] = []
        fair = self._fair
        # Fair policy with several tenants busy: each tenant's largest prefill chunk
        # while others wait, and its tokens this step beyond one per running request
        # (the fast path's share, capped at one token), which the slow path adds up;
        # a step that preempts or runs out recounts exactly.
        extra: dict[str, int] | None = None
        tenant_caps: dict[str, int] | None = None
        recount = False
        express: set[str] | None = None
        steps_since_express = 0
        if fair is not None and len(fair.active) > 1:
            extra = {}
            if may_express:
                express = fair.express_tenants()
            if express is None:
                tenant_caps = fair.chunk_caps(token_budget)
            else:
                # Its tenants have nothing running: the running requests all wait.
                recount = True
                steps_since_express = fair.steps_since_express
                fair.steps_since_express = 0
            fast_cap = min(fast_cap, 1)

        preempted = False
        # Iterate over a snapshot: preempting edits ``running`` mid-pass, and
        # requests preempted during the pass are skipped (a for loop over a copy
        # costs less per request than indexing with bookkeeping).
        for request in running.copy() if express is None else ():
            if preempted and request.status is not _RUNNING:
                continue
            num_computed = request.num_computed_tokens
            num_tokens = len(request.all_token_ids) + request.num_output_placeholders
            num_new = num_tokens - num_computed
            req_id = request.request_id
            # Fast path (most running requests, most steps): no drafts, within the
            # caps, and the KV cache manager says allocate_slots would be a no-op,
            # so the call is skipped.
            if (
                0 < num_new <= fast_cap
                and (no_drafts or not request.spec_token_ids)
                and num_tokens < next_allocation_at(req_id)
                and (no_mm or num_computed >= request.mm_end)
            ):
                num_computed_column.append(num_computed)
                num_scheduled[req_id] = num_new
                token_budget -= num_new
                if token_budget < fast_cap:
                    fast_cap = token_budget
                request.num_computed_tokens = num_tokens
                continue
            if token_budget <= 0:
                recount = True
                break
            spec = request.spec_token_ids
            if spec:
                # Without drafts num_tokens <= max_model_len already bounds num_new.
                num_new += len(spec)
                if num_new > max_model_len - num_computed:
                    num_new = max_model_len - num_computed
            if num_new > chunk_cap:
                num_new = chunk_cap
            if tenant_caps is not None and num_new > 1 and not spec:  # every cap is >= 1
                tenant_cap = tenant_caps.get(request.tenant)
                if tenant_cap is not None and num_new > tenant_cap:
                    num_new = tenant_cap
            if num_new > token_budget:
                num_new = token_budget
            if num_new <= 0:
                if extra is not None:
                    extra[request.tenant] = extra.get(request.tenant, 0) - 1
                continue
            encoder_inputs: list[int] = []
            encoder_tokens = 0
            if num_computed < request.mm_end:
                encoder_inputs, num_new, encoder_tokens = schedule_encoder_inputs(
                    request, num_computed, num_new, step.encoder_budget, self.encoder_cache_manager
                )
                if num_new <= 0:
                    if extra is not None:
                        extra[request.tenant] = extra.get(request.tenant, 0) - 1
                    continue
            # Draft tokens get slots as lookahead so the manager never caches
            # blocks holding unverified tokens.
            num_spec = 0
            if spec:
                num_spec = num_computed + num_new - num_tokens
                if num_spec < 0:
                    num_spec = 0
            new_blocks = allocate(request, num_new - num_spec, 0, None, num_spec)
            while new_blocks is None:
                victim_index = self._pick_victim()
                victim = running[victim_index]
                self._preempt(victim_index)
                preempted = True
                preempted_ids.add(victim.request_id)
                if victim is request:
                    break
                if victim.request_id in num_scheduled:
                    step.token_budget = token_budget
                    self._unschedule(step, victim, orphans)
                    token_budget = step.token_budget
                new_blocks = allocate(request, num_new - num_spec, 0, None, num_spec)
            if new_blocks is None:
                # It was the victim: the requests after it may still fit (under the
                # fair and priority policies the victim need not be the last).
                recount = True
                continue
            if num_computed < request.mm_end:
                self._claim_encoder_inputs(step, request, encoder_inputs, encoder_tokens)
                mm_scheduled.append(request)
            if num_spec and num_spec < len(spec):
                spec = spec[:num_spec]
                request.spec_token_ids = spec
            blocks = new_blocks.blocks
            step.token_budget = token_budget
            step.add_running(
                req_id,
                num_computed,
                num_new,
                [b.block_id for b in blocks] if blocks else None,
                spec if num_spec else None,
            )
            token_budget = step.token_budget
            if token_budget < fast_cap:
                fast_cap = token_budget
            request.num_computed_tokens = num_computed + num_new
            if extra is not None and num_new != 1:
                extra[request.tenant] = extra.get(request.tenant, 0) + num_new - 1
        step.token_budget = token_budget
        if fair is not None:
            if extra is None:
                fair.charge_step(None, self.scheduler_config.max_num_batched_tokens - token_budget)
            elif recount or preempted:
                fair.charge_step(fair.tally(num_scheduled, self.requests), 0)
            else:
                fair.charge_running(extra)

        if not preempted_ids and self.waiting:
            self._admit_waiting(step, mm_scheduled, preempted_ids, tenant_caps, orphans, express)
        if express is not None and not num_scheduled:
            # Nothing of theirs could start (no blocks, no seat to reclaim): a shared
            # step instead, which reports what this attempt preempted.
            assert fair is not None
            fair.steps_since_express = steps_since_express
            self._preempted_outside = preempted_ids
            return self._schedule(False)
        freed: list[str] = []
        if self._mm_seen:
            if orphans:
                self._settle_orphans(step, orphans, mm_scheduled)
            # Taken before the releases below: an output released now (and, with the
            # encoder cache off, dropped at once) is still read by this step.
            freed = self.encoder_cache_manager.get_freed_mm_hashes()
            for request in mm_scheduled:
                release_passed_encoder_inputs(request, self.encoder_cache_manager)

        num_common = 0
        if running and len(num_scheduled) == len(running):
            num_common = manager.get_num_common_prefix_blocks(running[0].request_id)
        finished = self.finished_req_ids
        self.finished_req_ids = set()
        output = step.build(num_common, preempted_ids, finished)
        if self._async_scheduling:
            self._add_output_placeholders(output.num_scheduled_tokens)
        if freed:
            output.free_encoder_mm_hashes = freed
        if self._kv is not None:
            output.kv_connector_metadata = self._kv.connector.build_connector_meta(output)
        return output

    def _add_output_placeholders(self, num_scheduled: dict[str, int]) -> None:
        """Async scheduling: each request this step brings level with its tokens
        samples one, unknown until the step's output: a placeholder lets the next
        step schedule the decode that follows it."""
        requests = self.requests
        for req_id in num_scheduled:
            request = requests[req_id]
            known = len(request.all_token_ids) + request.num_output_placeholders
            if request.num_computed_tokens >= known and request.pooling_params is None:
                request.num_output_placeholders += 1

    def _settle_orphans(
        self, step: StepBuilder, orphans: list[str], mm_scheduled: list[Request]
    ) -> None:
        """Items whose encoding left with a request preempted later in the step: a
        request still scheduled that took one from the cache encodes it instead;
        with no such request it is forgotten (never computed)."""
        cache = self.encoder_cache_manager
        scheduled = step.num_scheduled
        for identifier in orphans:
            refs = cache.cached.get(identifier) or ()
            heir = next(
                (r for r in mm_scheduled if r.request_id in refs and r.request_id in scheduled),
                None,
            )
            if heir is None or not cache.share:  # unshared: the heir encodes its own
                cache.discard(identifier)
                continue
            assert heir.mm_features is not None
            index = next(i for i, f in enumerate(heir.mm_features) if f.identifier == identifier)
            inputs = step.encoder_inputs.pop(heir.request_id, [])
            tokens = step.encoder_tokens.pop(heir.request_id, 0)
            step.encoder_budget += tokens
            step.add_encoder_inputs(
                heir.request_id, [*inputs, index], tokens + heir.get_num_encoder_tokens(index)
            )

    def _claim_encoder_inputs(
        self, step: StepBuilder, request: Request, input_ids: list[int], num_tokens: int
    ) -> None:
        """``request`` got its KV slots: the runner encodes ``input_ids`` this step."""
        if input_ids:
            step.add_encoder_inputs(request.request_id, input_ids, num_tokens)
            for input_id in input_ids:
                self.encoder_cache_manager.allocate(request, input_id)

    def _admit_waiting(
        self,
        step: StepBuilder,
        mm_scheduled: list[Request],
        preempted_ids: set[str],
        tenant_caps: dict[str, int] | None,
        orphans: list[str],
        only_tenants: set[str] | None = None,
    ) -> None:
        """Admit waiting requests in queue order within ``step``'s budget.

        Stops at the first request that does not fit (no reordering), so a
        large prompt is not overtaken by smaller ones behind it, unless the
        policy lets it take a running request's place (``_reclaim``).
        ``tenant_caps`` bounds each tenant's prompt chunk and ``only_tenants``
        (an express step) stops at the first request of another tenant (fair
        policy).
        """
        config = self.scheduler_config
        chunked = config.enable_chunked_prefill
        caching = self.cache_config.enable_prefix_caching
        manager = self.kv_cache_manager
        waiting = self.waiting
        running = self.running
        max_loras = self._max_loras
        adapters = {r.lora_int_id for r in running if r.lora_int_id} if max_loras else set()
        fair = self._fair
        num_running = len(running)  # requests admitted by this call come after these
        reclaimed = False
        kv = self._kv
        skipped: list[Request] = []
        while waiting and step.token_budget > 0:
            request = waiting.peek()
            if request.request_id in preempted_ids:
                break  # taken out this step (a reclaimed seat): it resumes in a later one
            if only_tenants is not None and request.tenant not in only_tenants:
                break
            seats_full = len(running) >= config.max_num_seqs
            if seats_full and (reclaimed or fair is None):
                break
            if request.status == _WAITING_FOR_REMOTE_KVS:
                assert kv is not None
                if not kv.ready(request):  # still loading: it keeps its place
                    skipped.append(waiting.pop())
                    continue
            if request.status == _WAITING_FOR_FSM:
                ready = self._grammar_ready(request)
                if ready is None:  # the grammar failed to compile
                    waiting.pop()
                    self._ignore(request, RequestStatus.FINISHED_ABORTED)
                    continue
                if not ready:  # still compiling: it keeps its place in the queue
                    skipped.append(waiting.pop())
                    continue
            if self._unservable(request):
                waiting.pop()
                self._ignore(request)
                continue
            lora_id = request.lora_int_id if max_loras else 0
            if lora_id and lora_id not in adapters and len(adapters) >= max_loras:
                skipped.append(waiting.pop())  # another adapter would exceed max_loras
                continue
            if seats_full:
                if not self._reclaim(request, step, preempted_ids, num_running, orphans):
                    break
                reclaimed = True
                num_running -= 1
                continue
            # Only a request whose KV a connector loaded arrives with computed tokens.
            num_loaded = request.num_computed_tokens
            pooling = request.pooling_params
            if num_loaded:
                computed_blocks, num_cached = None, num_loaded
            elif caching and (pooling is None or not pooling.skip_reading_prefix_cache):
                computed_blocks, num_cached = manager.get_computed_blocks(request)
            else:
                computed_blocks, num_cached = None, 0
            num_external, load_async = 0, False
            # A pooling request needs its prompt's hidden states, which stored KV lacks.
            if kv is not None and not num_loaded and pooling is None:
                matched = kv.match(request, num_cached)
                if matched is None:  # the connector cannot tell yet
                    skipped.append(waiting.pop())
                    continue
                num_external, load_async = matched
            num_tokens = request.num_tokens
            num_new = num_tokens - num_cached - num_external
            if load_async:
                num_new = 0
            elif chunked:
                num_new = min(num_new, self._chunk_cap, step.token_budget)
                if tenant_caps is not None:
                    num_new = min(num_new, tenant_caps.get(request.tenant, num_new))
            elif num_new > config.max_num_batched_tokens:
                waiting.pop()
                self._ignore(request)
                continue
            elif num_new > step.token_budget:
                break
            # Tokens this step does not compute: the prefix hit and what the connector loads.
            start = num_cached + num_external
            encoder_inputs: list[int] = []
            encoder_tokens = 0
            if not load_async and start < request.mm_end:
                encoder_inputs, num_new, encoder_tokens = schedule_encoder_inputs(
                    request, start, num_new, step.encoder_budget, self.encoder_cache_manager
                )
                if num_new <= 0:
                    # Its next item cannot be encoded this step: it waits in front,
                    # holding no encoder output meanwhile.
                    self.encoder_cache_manager.free(request)
                    break
            if kv is None:
                allocated = (
                    manager.allocate_slots(request, num_new, num_cached, computed_blocks)
                    is not None
                )
            else:
                allocated = self._allocate_with_connector(
                    request,
                    num_new + num_external,
                    num_cached - num_loaded,
                    computed_blocks,
                    load_async,
                )
            if not allocated:
                if request.mm_features:
                    self.encoder_cache_manager.free(request)
                if reclaimed or not self._reclaim(
                    request, step, preempted_ids, num_running, orphans
                ):
                    break
                reclaimed = True
                num_running -= 1
                continue  # the freed blocks may hold a prefix it would have hit: look again
            if kv is not None and not num_loaded:
                kv.after_alloc(request, num_cached, num_external, load_async)
            if caching and not num_loaded:
                self._prefix_queries += num_tokens
                self._prefix_hits += num_cached
            if load_async:  # it waits, with its blocks, while the connector loads
                skipped.append(waiting.pop())
                continue
            num_cached = start
            if num_cached < request.mm_end:
                self._claim_encoder_inputs(step, request, encoder_inputs, encoder_tokens)
                mm_scheduled.append(request)
            waiting.pop()
            if fair is None:
                running.append(request)
            else:
                fair.admitted(request, num_new, running)  # in arrival order
            if lora_id:
                adapters.add(lora_id)
            req_id = request.request_id
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            if request.status == _WAITING:
                step.add_new(
                    NewRequestData(
                        req_id=req_id,
                        prompt_token_ids=request.prompt_token_ids,
                        sampling_params=request.sampling_params,
                        block_ids=manager.get_block_ids(req_id),
                        num_computed_tokens=num_cached,
                        stopping_token_ids=request.stopping_token_ids,
                        lora_request=request.lora_request,
                        output_token_ids=list(request.output_token_ids),
                        mm_features=request.mm_features,
                        pooling_params=request.pooling_params,
                    ),
                    num_new,
                )
            else:
                step.add_resumed(
                    req_id,
                    request.output_token_ids,
                    manager.get_block_ids(req_id),
                    num_cached,
                    num_new,
                )
            request.status = _RUNNING
            request.num_computed_tokens = num_cached + num_new
        for request in reversed(skipped):
            waiting.prepend(request)

    def _allocate_with_connector(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        computed_blocks: KVCacheBlocks | None,
        load_async: bool,
    ) -> bool:
        """``allocate_slots`` for an admission with a KV connector. Waiting requests
        hold blocks (loading or loaded): when the blocks run out with nothing
        running, the loaded blocks of other waiting requests are given back (they
        are asked for again when their turn comes), so such requests never wait
        on each other forever."""
        assert self._kv is not None
        manager = self.kv_cache_manager
        while True:
            blocks = manager.allocate_slots(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                computed_blocks,
                delay_cache_blocks=load_async,
            )
            if blocks is not None:
                return True
            if self.running or not self._kv.reclaim(self.waiting, request):
                return False

    @staticmethod
    def _grammar_ready(request: Request) -> bool | None:
        """True (and WAITING now) once the grammar compiled, False while it compiles,
        None when the compile failed (or refused the output a resumed request brings)."""
        structured = request.structured_output_request
        assert structured is not None
        if not structured.is_ready():
            return False
        if structured.error is not None:
            logger.error("request %s: %s", request.request_id, structured.error)
            return None
        prior = request.output_token_ids
        if prior and structured.grammar is not None:
            # A request resumed after an engine crash: its grammar state follows its output.
            if not structured.accept_output(prior):
                logger.error(
                    "request %s: the grammar refused its resumed output", request.request_id
                )
                return None
        request.status = _WAITING
        return True

    @property
    def has_structured_requests(self) -> bool:
        """Whether any request (running or waiting) has a grammar."""
        return self._num_structured > 0

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The step's grammar bitmask: rows for the structured requests that sample in it.

        None when there are none (unstructured batches pay one integer check).
        A request samples when this step brings it up to all its tokens (drafts
        included); a partial prefill gets no row.
        """
        if not self._num_structured:
            return None
        assert self.structured_output_manager is not None
        requests = self.requests
        structured = []
        also_allowed: dict[str, int] = {}
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None or request.structured_output_request is None:
                continue
            structured_request = request.structured_output_request
            matcher = structured_request.grammar
            if (
                matcher is not None
                and request.num_computed_tokens >= request.num_tokens
                and not structured_request.reasoning.thinking  # thinking is free
            ):
                structured.append((req_id, matcher))
                extra = structured_request.reasoning.also_allowed
                if extra is not None:
                    also_allowed[req_id] = extra
        if not structured:
            return None
        return self.structured_output_manager.grammar_bitmask(
            structured, scheduler_output.scheduled_spec_decode_tokens, also_allowed
        )

    def _forget(self, req_id: str, running: bool = False) -> Request | None:
        """Take a request out of ``requests`` (None if it is not there), keeping the
        count of structured requests in step."""
        request = self.requests.pop(req_id, None)
        if request is not None:
            if request.structured_output_request is not None:
                self._num_structured -= 1
            if self._fair is not None:
                self._fair.leave(request, running)
        return request

    def _unservable(self, request: Request) -> bool:
        num_tokens = request.num_tokens
        if request.mm_features and any(
            f.mm_position.length > self._max_encoder_item for f in request.mm_features
        ):
            return True  # an item the encoder budget or cache can never take whole
        return (
            num_tokens > self.max_model_len
            or -(-num_tokens // self.block_size) > self._capacity_blocks
        )

    def _ignore(
        self, request: Request, status: RequestStatus = RequestStatus.FINISHED_IGNORED
    ) -> None:
        """Finish a request that can never run; reported by the next update_from_output."""
        if request.mm_features:
            self.encoder_cache_manager.free(request)
        request.status = status
        self._forget(request.request_id)
        self.finished_req_ids.add(request.request_id)
        self._ignored.append(request)

    def _pick_victim(self) -> int:
        """Index in ``running`` of the request to preempt: the policy's choice (the last
        one under FCFS, the worst priority under the priority policy, the latest of
        the tenant furthest ahead under the fair policy)."""
        return self.waiting.pick_victim(self.running)

    def _reclaim(
        self,
        request: Request,
        step: StepBuilder,
        preempted_ids: set[str],
        num_running: int,
        orphans: list[str],
    ) -> bool:
        """Preempt the running request (one of the first ``num_running``, which were not
        admitted this step) the policy names to make room for ``request``; False if none.
        Items the victim was to encode this step go to ``orphans``."""
        index = self.waiting.reclaim_victim(request, self.running, num_running)
        if index is None:
            return False
        victim = self.running[index]
        num_scheduled = step.num_scheduled.get(victim.request_id)
        if num_scheduled is not None:
            self._unschedule(step, victim, orphans)
            if self._fair is not None:
                self._fair.charge(victim, -num_scheduled)
        self._preempt(index)
        preempted_ids.add(victim.request_id)
        return True

    @staticmethod
    def _unschedule(step: StepBuilder, victim: Request, orphans: list[str]) -> None:
        """Take back ``victim``'s place in this step (it is being preempted); the
        encoder inputs it was to encode go to ``orphans`` (see ``_settle_orphans``)."""
        taken = step.encoder_inputs.get(victim.request_id)
        if taken and victim.mm_features:
            orphans.extend(victim.mm_features[i].identifier for i in taken)
        step.unschedule(victim.request_id)

    def _preempt(self, index: int) -> None:
        """Free a running request's blocks and put it back in front of the queue."""
        request = self.running.pop(index)
        self.kv_cache_manager.free(request)
        if request.mm_features:
            self.encoder_cache_manager.free(request)
        if self._fair is not None:
            self._fair.preempted(request)
        request.status = _PREEMPTED
        request.num_computed_tokens = 0
        # A step still running may have sampled for it: update_from_output keeps
        # that token (async scheduling), which the resumed request then includes.
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        request.spec_token_ids = []
        self._num_preemptions += 1
        self.waiting.prepend(request)

    # ------------------------------------------------------------------ outputs

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Append each request's sampled tokens, up to its first stop.

        Requests finished, aborted or preempted since ``schedule()`` are skipped.
        Finished requests free their blocks at once (unless a KV connector holds
        them) and leave ``requests``; their ids go out in the next
        ``SchedulerOutput.finished_req_ids``. A running request that computed on
        blocks which failed to load is preempted, its tokens of the step dropped.
        """
        kv_output = model_runner_output.kv_connector_output
        if kv_output is not None and self._kv is not None:
            for victim in self._kv.before_output(kv_output, self.running, self.waiting):
                self._preempted_outside.add(victim.request_id)
                self._preempt(self.running.index(victim))
        requests = self.requests
        get_request = requests.get
        logprobs_all = model_runner_output.logprobs
        drafts_seen = self._drafts_seen
        spec_scheduled = scheduler_output.scheduled_spec_decode_tokens
        max_model_len = self.max_model_len
        running_status = _RUNNING
        async_scheduling = self._async_scheduling
        # Preempted requests finished by their in-flight token (async scheduling).
        waiting_finished: set[str] = set()

        per_client: dict[int, list[EngineCoreOutput]] = {}
        client = -1
        client_outputs: list[EngineCoreOutput] = []
        finished: list[tuple[Request, EngineCoreOutput]] = []
        req_ids = model_runner_output.req_ids
        # Without logprobs (the common case) a run of Nones rides along in the zip.
        logprobs_iter = repeat(None, len(req_ids)) if logprobs_all is None else logprobs_all
        for req_id, sampled, logprobs in zip(
            req_ids, model_runner_output.sampled_token_ids, logprobs_iter, strict=True
        ):
            request = get_request(req_id)
            # Finished, aborted or preempted since schedule() (a request re-added
            # under the same id is WAITING): nothing to apply. Except, with async
            # scheduling, a request the next step's scheduling preempted while this
            # step ran: its token was sampled from its whole context, so it is kept
            # (dropping it, a request that preempts itself would never progress).
            if request is None or request.status is not running_status:
                if not (async_scheduling and sampled and request is not None):
                    continue
                if request.status is not _PREEMPTED:
                    continue
                waiting_finished.add(req_id)
            if drafts_seen:
                if request.spec_token_ids:
                    request.spec_token_ids = []
                if spec_scheduled:
                    drafts = spec_scheduled.get(req_id)
                    if drafts:
                        accepted = len(sampled) - 1 if sampled else 0
                        request.num_computed_tokens -= len(drafts) - accepted
                        if self.log_stats:
                            self._observe_drafts(len(drafts), accepted)
            if not sampled:
                continue  # a partial prefill produces no token
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
            kept = request.append_output_token_ids(sampled, max_model_len)
            if request.client_index != client:
                client = request.client_index
                client_outputs = per_client.setdefault(client, [])
            if kept is None:  # still running: every sampled token was appended
                client_outputs.append(
                    EngineCoreOutput(
                        req_id, sampled, None, None, request.num_cached_tokens, logprobs
                    )
                )
            else:
                if logprobs is not None and len(logprobs) > len(kept):
                    logprobs = logprobs[: len(kept)]
                last = EngineCoreOutput(
                    req_id,
                    kept,
                    request.get_finished_reason(),
                    request.stop_reason,
                    request.num_cached_tokens,
                    logprobs,
                )
                client_outputs.append(last)
                finished.append((request, last))

        pooler_output = model_runner_output.pooler_output
        if pooler_output is not None:
            self._finish_pooled(req_ids, pooler_output, per_client, finished)

        finished_ids: dict[int, set[str]] = {}
        if finished:
            free = self.kv_cache_manager.free
            kv = self._kv
            for request, last in finished:
                if kv is None:
                    free(request)
                else:
                    last.kv_transfer_params = kv.finish(request)
                if request.mm_features:
                    self.encoder_cache_manager.free(request)
                req_id = request.request_id
                self._forget(req_id, running=req_id not in waiting_finished)
                self.finished_req_ids.add(req_id)
                finished_ids.setdefault(request.client_index, set()).add(req_id)
            gone = {request for request, _ in finished}
            self.running = [r for r in self.running if r not in gone]
            if waiting_finished:
                self.waiting.remove(r for r, _ in finished if r.request_id in waiting_finished)
        if kv_output is not None and self._kv is not None:
            self._kv.after_output(kv_output)

        if self._ignored:
            for request in self._ignored:
                req_id = request.request_id
                per_client.setdefault(request.client_index, []).append(
                    EngineCoreOutput(req_id, [], request.get_finished_reason())
                )
                finished_ids.setdefault(request.client_index, set()).add(req_id)
            self._ignored = []
        if self._finished_outside:
            for client_index, req_id in self._finished_outside:
                finished_ids.setdefault(client_index, set()).add(req_id)
                per_client.setdefault(client_index, [])
            self._finished_outside = []

        if finished_ids:
            result = {
                c: EngineCoreOutputs(outputs=outs, finished_requests=finished_ids.get(c))
                for c, outs in per_client.items()
            }
        else:
            result = {c: EngineCoreOutputs(outputs=outs) for c, outs in per_client.items()}
        if self.log_stats:
            # Stats hold deltas, so they ride on one client's outputs only.
            first = min(result) if result else 0
            result.setdefault(first, EngineCoreOutputs()).scheduler_stats = self.make_stats()
        return result

    def _finish_pooled(
        self,
        req_ids: list[str],
        pooler_output: list[bytes | None],
        per_client: dict[int, list[EngineCoreOutput]],
        finished: list[tuple[Request, EngineCoreOutput]],
    ) -> None:
        """Finish the pooling requests whose pooled output came back: their last
        prompt token was computed, and a pooling request never decodes."""
        for req_id, pooled in zip(req_ids, pooler_output, strict=True):
            if pooled is None:
                continue  # a partial prefill
            request = self.requests.get(req_id)
            if request is None or request.status is not _RUNNING:
                continue
            request.status = RequestStatus.FINISHED_STOPPED
            last = EngineCoreOutput(
                req_id,
                [],
                FinishReason.STOP,
                num_cached_tokens=request.num_cached_tokens,
                pooling_output=pooled,
            )
            finished.append((request, last))
            per_client.setdefault(request.client_index, []).append(last)

    def _observe_drafts(self, num_drafts: int, num_accepted: int) -> None:
        stats = self._spec_stats
        if stats is None:
            stats = self._spec_stats = SpecDecodingStats.new(self.num_speculative_tokens)
        stats.observe_draft(num_drafts, num_accepted)

    # ------------------------------------------------------------------ misc

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget cached blocks. With ``reset_running_requests``, running requests are
        preempted first (reported in the next step's ``preempted_req_ids``, which
        then admits nothing) so that every block can be released."""
        if reset_running_requests:
            while self.running:
                self._preempted_outside.add(self.running[-1].request_id)
                self._preempt(len(self.running) - 1)
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats | None:
        """Gauges now, and prefix-cache/preemption/draft counts since the previous call."""
        if not self.log_stats:
            return None
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=self._prefix_queries,
            prefix_cache_hits=self._prefix_hits,
            num_preemptions=self._num_preemptions,
            spec_decoding_stats=self._spec_stats,
        )
        self._prefix_queries = self._prefix_hits = self._num_preemptions = 0
        self._spec_stats = None
        if self._kv is not None:
            stats.kv_transfer_stats = self._kv.take_stats()
        if self.structured_output_manager is not None:
            grammar_stats = self.structured_output_manager.make_stats()
            stats.num_structured_requests = grammar_stats.num_requests
            stats.grammar_compile_times = grammar_stats.compile_times
            stats.grammar_cache_hits = grammar_stats.num_cache_hits
        return stats

    def shutdown(self) -> None:
        """The scheduler owns no threads, files or devices; its KV connector may."""
        if self.connector is not None:
            self.connector.shutdown()
