"""What each step ran, for the dashboard: batch composition and a KV cache map.

``StepObserver`` is called by the engine core after every step, outside the
scheduler, so that ``schedule()`` and ``update_from_output()`` cost the same
whether anyone watches or not. The batch composition is read off the
``SchedulerOutput`` with a few C-level passes; the block map walks every
block, so it is taken at most every ``block_map_interval_s``.
"""

from __future__ import annotations

import time

from tokenloom.core.kv_cache.block_map import kv_block_map
from tokenloom.core.kv_cache.manager import KVCacheManager
from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.outputs import StepStats

# The dashboard redraws the block map about this often.
BLOCK_MAP_INTERVAL_S = 0.25


def batch_composition(scheduler_output: SchedulerOutput) -> tuple[int, int, int]:
    """(prefill, decode, draft) tokens of one step.

    A decode is a request the runner already holds that gets one new token
    (plus its drafts). A new request's single token (a one-token prompt, or
    the recomputed last token of a full prefix hit) is prefill; the rare
    one-token last chunk of a longer prompt counts as a decode.
    """
    num_scheduled = scheduler_output.num_scheduled_tokens
    spec = scheduler_output.scheduled_spec_decode_tokens
    if spec:
        num_draft = sum(map(len, spec.values()))
        num_decode = sum(
            1 for req_id, n in num_scheduled.items() if n - len(spec.get(req_id, ())) == 1
        )
    else:
        num_draft = 0
        num_decode = list(num_scheduled.values()).count(1)
    for new_request in scheduler_output.scheduled_new_reqs:
        if num_scheduled[new_request.req_id] == 1:
            num_decode -= 1
    num_prefill = scheduler_output.total_num_scheduled_tokens - num_decode - num_draft
    return num_prefill, num_decode, num_draft


class StepObserver:
    """Turns each step into ``StepStats``, and now and then a KV block map."""

    def __init__(
        self, kv_cache_manager: KVCacheManager, block_map_interval_s: float = BLOCK_MAP_INTERVAL_S
    ) -> None:
        self._manager = kv_cache_manager
        self._interval_s = block_map_interval_s
        self._next_map_at = 0.0
        self._index = 0

    def observe(
        self, scheduler_output: SchedulerOutput, started: float, ended: float
    ) -> tuple[StepStats, bytes | None]:
        """The step that ran from ``started`` to ``ended`` (``time.perf_counter()``),
        and the block map when one is due."""
        prefill, decode, draft = batch_composition(scheduler_output)
        preempted = scheduler_output.preempted_req_ids
        stats = StepStats(
            index=self._index,
            timestamp=time.time(),
            duration_s=ended - started,
            num_reqs=len(scheduler_output.num_scheduled_tokens),
            num_prefill_tokens=prefill,
            num_decode_tokens=decode,
            num_draft_tokens=draft,
            preempted_req_ids=list(preempted) if preempted else [],
        )
        self._index += 1
        block_map = None
        if ended >= self._next_map_at:
            self._next_map_at = ended + self._interval_s
            block_map = kv_block_map(self._manager.block_pool)
        return stats, block_map
