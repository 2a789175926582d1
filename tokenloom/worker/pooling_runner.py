"""The pooling side of the model runner (``--runner pooling``): which hidden states
a step keeps, and the pooled vector of every request whose prompt it completes.

Requests are prefilled like any prompt, possibly in chunks over several steps,
and never sample. ``LAST`` pooling keeps one row per request, its last prompt
token, in the step that computes it (the rows the generate path takes logits
from). ``CLS`` keeps the first prompt token's row when its chunk is computed
and holds it until the prompt completes. ``MEAN`` keeps every row and adds each
request's rows to a float32 running sum, divided by the prompt length at the
end. A request whose chunk starts at position 0 starts over (it was preempted,
or is new); ``CLS`` and ``MEAN`` requests always compute their whole prompt
(the scheduler skips their prefix-cache hits, see ``PoolingParams``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.pooling.config import PoolerConfig
from tokenloom.pooling.methods import finish_vectors, segment_sums
from tokenloom.pooling_params import PoolingParams
from tokenloom.worker.step_inputs import StepInputs


@dataclass
class _Partial:
    """What a CLS or MEAN request has pooled from its chunks so far."""

    num_tokens: int = 0  # prompt tokens pooled (MEAN)
    total: torch.Tensor | None = None  # their float32 sum (MEAN), or the first row (CLS)


class PoolingRunner:
    """Per-request pooling parameters and partial pools, and the step's pooling."""

    def __init__(self, config: PoolerConfig) -> None:
        if config.pooling_type is None:
            raise ValueError("the pooling runner needs a resolved pooler config")
        self.config = config
        self.pooling_type = config.pooling_type
        self._params: dict[str, PoolingParams] = {}
        self._partial: dict[str, _Partial] = {}

    def update_requests(self, scheduler_output: SchedulerOutput) -> None:
        """Take the new requests' parameters; forget finished requests, and the
        partial pools of preempted ones (they are recomputed from the start)."""
        for req_id in scheduler_output.finished_req_ids:
            self._params.pop(req_id, None)
            self._partial.pop(req_id, None)
        for req_id in scheduler_output.preempted_req_ids:
            self._partial.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._params[new.req_id] = new.pooling_params or PoolingParams()

    def keep_rows(self, step: StepInputs) -> torch.Tensor | None:
        """The flat-batch rows whose final hidden states pooling reads (None: all)."""
        if self.pooling_type == "MEAN":
            return None
        if self.pooling_type == "LAST":
            return step.logits_indices
        starts = step.seq_lens - step.query_lens
        first_rows = (np.cumsum(step.query_lens) - step.query_lens)[starts == 0]
        return torch.from_numpy(first_rows).to(step.logits_indices.device)

    def pool(self, step: StepInputs, hidden: torch.Tensor) -> list[bytes | None]:
        """The pooled vector of each request in ``step.req_ids`` whose prompt this step
        completes (``step.sample_idx``), None for the others; ``hidden`` holds the rows
        ``keep_rows`` asked for."""
        out: list[bytes | None] = [None] * len(step.req_ids)
        done = step.sample_idx.tolist()
        if self.pooling_type == "LAST":
            vectors = hidden
        else:
            vectors = self._accumulate(step, hidden, done)
        if not done:
            return out
        params = [self._params[step.req_ids[i]] for i in done]
        pooled = finish_vectors(
            vectors,
            [p.dimensions for p in params],
            [p.normalize is not False for p in params],
        )
        for i, vector in zip(done, pooled, strict=True):
            out[i] = vector
        return out

    def _accumulate(self, step: StepInputs, hidden: torch.Tensor, done: list[int]) -> torch.Tensor:
        """Fold this step's rows into the CLS and MEAN partial pools; the pooled
        vectors [len(done), H] of the requests that complete."""
        starts = (step.seq_lens - step.query_lens).tolist()
        if self.pooling_type == "MEAN":
            sums = segment_sums(hidden, torch.from_numpy(step.query_lens))
        partial = self._partial
        first_row = 0
        for i, (req_id, start) in enumerate(zip(step.req_ids, starts, strict=True)):
            if start == 0:
                partial[req_id] = _Partial()
            state = partial.get(req_id)
            if state is None:
                raise RuntimeError(
                    f"request {req_id} resumes {self.pooling_type} pooling at token {start} "
                    "without its earlier tokens (a prefix-cache hit it should have skipped)"
                )
            if self.pooling_type == "MEAN":
                if state.num_tokens != start:
                    raise RuntimeError(
                        f"request {req_id}: mean pooling got token {start} after "
                        f"{state.num_tokens} tokens"
                    )
                state.total = sums[i] if state.total is None else state.total + sums[i]
                state.num_tokens += int(step.query_lens[i])
            elif start == 0:
                state.total = hidden[first_row].float()
                first_row += 1
        vectors = []
        for i in done:
            state = partial.pop(step.req_ids[i])
            assert state.total is not None
            vectors.append(
                state.total / state.num_tokens if self.pooling_type == "MEAN" else state.total
            )
        return torch.stack(vectors) if vectors else hidden[:0].float()
