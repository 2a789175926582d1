"""Builds one step's SchedulerOutput while the scheduler walks its requests.

The scheduler decides; the builder records the decisions and the token budget
they use up, and assembles the contract's column-wise ``CachedRequestData``.
Running requests are added first (``add_running``), then new and resumed
ones; a running request scheduled earlier in the step can be taken out again
when it is preempted (``unschedule``).

The scheduler's loop over running requests inlines ``add_running`` for the
common decode step (no new blocks, no drafts): it sets ``num_scheduled``,
appends to ``num_computed`` through a bound method, and keeps the budget in a
local, which it stores back into ``token_budget`` before calling any method
here. To keep that path short, the ``req_ids`` and ``new_block_ids`` columns
are only built in ``build()``: running requests are the first entries of
``num_scheduled`` (dicts keep insertion order), and new blocks are kept by
column index.
"""

from __future__ import annotations

from itertools import islice, repeat

from tokenloom.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput


class StepBuilder:
    """One step's scheduling decisions; ``build()`` turns them into a SchedulerOutput.

    Cached-request columns run over the running requests in scheduling order,
    then the resumed ones: ``num_computed`` holds each one's computed tokens at
    the start of the step, ``new_block_ids`` maps a column index to the blocks
    its request got this step (the other rows get None).
    """

    __slots__ = (
        "token_budget", "num_scheduled", "spec_tokens", "num_computed", "new_block_ids",
        "resumed", "new_reqs", "_initial_budget", "encoder_budget", "encoder_inputs",
        "encoder_tokens",
    )  # fmt: skip

    def __init__(self, token_budget: int, encoder_budget: int = 0) -> None:
        self._initial_budget = token_budget
        # Encoder tokens left this step, and each request's items to encode with their
        # total tokens (so that unschedule can give them back).
        self.encoder_budget = encoder_budget
        self.encoder_inputs: dict[str, list[int]] = {}
        self.encoder_tokens: dict[str, int] = {}
        self.token_budget = token_budget
        self.num_scheduled: dict[str, int] = {}
        self.spec_tokens: dict[str, list[int]] = {}
        self.num_computed: list[int] = []
        self.new_block_ids: dict[int, list[int]] = {}
        # (request id, output tokens so far) of resumed requests, in order.
        self.resumed: list[tuple[str, list[int]]] = []
        self.new_reqs: list[NewRequestData] = []

    def add_running(
        self,
        req_id: str,
        num_computed: int,
        num_new: int,
        new_block_ids: list[int] | None,
        spec_token_ids: list[int] | None = None,
    ) -> None:
        """A running request gets ``num_new`` tokens (drafts included), after ``num_computed``.

        Only before any request is admitted: running requests come first.
        """
        if new_block_ids is not None:
            self.new_block_ids[len(self.num_computed)] = new_block_ids
        self.num_computed.append(num_computed)
        self.num_scheduled[req_id] = num_new
        self.token_budget -= num_new
        if spec_token_ids:
            self.spec_tokens[req_id] = spec_token_ids

    def add_new(self, new_request: NewRequestData, num_new: int) -> None:
        """A request the runner has not seen gets ``num_new`` tokens."""
        self.new_reqs.append(new_request)
        self.num_scheduled[new_request.req_id] = num_new
        self.token_budget -= num_new

    def add_resumed(
        self,
        req_id: str,
        output_token_ids: list[int],
        block_ids: list[int],
        num_computed: int,
        num_new: int,
    ) -> None:
        """A preempted request comes back with its outputs so far and its whole block list."""
        self.resumed.append((req_id, list(output_token_ids)))
        self.new_block_ids[len(self.num_computed)] = block_ids
        self.num_computed.append(num_computed)
        self.num_scheduled[req_id] = num_new
        self.token_budget -= num_new

    def add_encoder_inputs(self, req_id: str, input_ids: list[int], num_tokens: int) -> None:
        """A scheduled request's items the runner encodes this step (``num_tokens`` in all)."""
        self.encoder_inputs[req_id] = input_ids
        self.encoder_tokens[req_id] = num_tokens
        self.encoder_budget -= num_tokens

    def unschedule(self, req_id: str) -> None:
        """Take back a running request added earlier in this step (it was preempted)."""
        if self.encoder_inputs.pop(req_id, None) is not None:
            self.encoder_budget += self.encoder_tokens.pop(req_id)
        i = list(self.num_scheduled).index(req_id)  # its column: running ones come first
        del self.num_computed[i]
        self.new_block_ids = {
            j - (j > i): blocks for j, blocks in self.new_block_ids.items() if j != i
        }
        self.spec_tokens.pop(req_id, None)
        self.token_budget += self.num_scheduled.pop(req_id)

    def build(
        self,
        num_common_prefix_blocks: int,
        preempted_req_ids: set[str],
        finished_req_ids: set[str],
    ) -> SchedulerOutput:
        num_columns = len(self.num_computed)
        num_running = num_columns - len(self.resumed)
        req_ids = list(islice(self.num_scheduled, num_running))
        # A fresh empty list per running request (the runner already holds their tokens).
        new_token_ids: list[list[int]] = list(map(list, repeat((), num_running)))
        for req_id, output_token_ids in self.resumed:
            req_ids.append(req_id)
            new_token_ids.append(output_token_ids)
        new_block_ids: list[list[int] | None] = [None] * num_columns
        for i, blocks in self.new_block_ids.items():
            new_block_ids[i] = blocks
        return SchedulerOutput(
            scheduled_new_reqs=self.new_reqs,
            scheduled_cached_reqs=CachedRequestData(
                req_ids=req_ids,
                resumed_req_ids={req_id for req_id, _ in self.resumed},
                new_token_ids=new_token_ids,
                new_block_ids=new_block_ids,
                num_computed_tokens=self.num_computed,
            ),
            num_scheduled_tokens=self.num_scheduled,
            total_num_scheduled_tokens=self._initial_budget - self.token_budget,
            scheduled_spec_decode_tokens=self.spec_tokens,
            num_common_prefix_blocks=num_common_prefix_blocks,
            preempted_req_ids=preempted_req_ids,
            finished_req_ids=finished_req_ids,
            scheduled_encoder_inputs=self.encoder_inputs,
        )
