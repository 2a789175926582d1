"""The runner's side of speculative decoding: verify this step's drafts, propose the next.

``Speculator`` is owned by the ``ModelRunner`` when a ``SpeculativeConfig`` is
set. Each step the runner hands it the logits rows of the requests that
sample (drafts first, then the bonus row, per request) and it returns the
kept tokens (``verifier.verify``); after the step it proposes drafts for the
requests that sampled, within each one's ``DraftBudget`` cap and what is
left of its ``max_tokens`` and of ``max_model_len``. The engine core collects
them with ``take_draft_token_ids`` and gives them to the scheduler
(``update_draft_token_ids``), which schedules them next step.

The draft model's proposal step also runs when no request drafts (it keeps
the draft KV cache level with the target's); the n-gram proposer has no state.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenloom.config import ModelConfig, SpeculativeConfig
from tokenloom.outputs import TokenLogprobs
from tokenloom.worker.input_batch import InputBatch
from tokenloom.worker.sampler import Sampler
from tokenloom.worker.sampling_metadata import SamplingMetadata
from tokenloom.worker.spec_decode.draft_budget import DraftBudget
from tokenloom.worker.spec_decode.draft_model import DraftModelProposer
from tokenloom.worker.spec_decode.ngram_proposer import NgramProposer
from tokenloom.worker.spec_decode.verifier import verify


class Speculator:
    """Drafts, their distributions (draft model), budgets; keyed by request id."""

    def __init__(
        self,
        config: SpeculativeConfig,
        model_config: ModelConfig,
        vocab_size: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        generator: torch.Generator | None,
    ) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.budget = DraftBudget(self.k, config.disable_by_batch_size)
        self.ngram: NgramProposer | None = None
        self.draft_model: DraftModelProposer | None = None
        if config.method == "ngram":
            self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, self.k)
        else:
            self.draft_model = DraftModelProposer(
                config,
                model_config,
                vocab_size,
                block_size,
                max_num_seqs,
                max_model_len,
                generator,
            )
        self._drafts: dict[str, list[int]] = {}
        self._draft_probs: dict[str, torch.Tensor] = {}

    def kv_cache_bytes(self, num_blocks: int) -> int:
        """Memory the draft model's KV cache takes beside a target cache of ``num_blocks``
        blocks (0 for n-gram), for the runner's sizing."""
        draft = self.draft_model
        if draft is None:
            return 0
        return num_blocks * draft.kv_bytes_per_block + draft.kv_scratch_bytes

    def allocate_kv_cache(self, num_blocks: int) -> None:
        if self.draft_model is not None:
            self.draft_model.allocate_kv_cache(num_blocks)

    # ------------------------------------------------------------------ verify

    def verify(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        sampler: Sampler,
        req_ids: list[str],
        drafts: list[list[int]],
    ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None] | None]:
        """Kept tokens (and logprobs) of each request sampling this step, in order.

        ``drafts[g]``: the drafts scheduled for ``req_ids[g]`` (possibly none).
        """
        pending, self._draft_probs = self._draft_probs, {}
        draft_probs: list[torch.Tensor | None] | None = None
        if pending:
            draft_probs = []
            for req_id, proposed in zip(req_ids, drafts, strict=True):
                q = pending.get(req_id)
                # The scheduler may have cut the drafts short, never changed them.
                usable = q is not None and 0 < len(proposed) <= q.shape[0]
                draft_probs.append(q[: len(proposed)] if usable else None)  # type: ignore[index]
        result = verify(logits, metadata, sampler, drafts, draft_probs)
        observe = self.budget.observe
        for req_id, proposed, kept in zip(req_ids, drafts, result.token_ids, strict=True):
            if proposed:
                observe(req_id, len(proposed), len(kept) - 1)
        return result.token_ids, result.logprobs

    # ------------------------------------------------------------------ propose

    def propose(
        self,
        batch: InputBatch,
        req_ids: list[str],
        slots: np.ndarray,
        starts: np.ndarray,
        seq_lens: np.ndarray,
        sampled: np.ndarray,
    ) -> None:
        """Drafts for the requests of this step that sampled (``sampled[i]``).

        ``starts``/``seq_lens``: each request's computed tokens before and after the
        step's forward pass (the draft model recomputes the kept ones).
        """
        self._drafts = {}
        caps = np.zeros(len(req_ids), np.int64)
        if sampled.any() and self.budget.enabled(len(req_ids)):
            picked = np.flatnonzero(sampled)
            room = np.fromiter((self._room(batch, int(slots[i])) for i in picked), np.int64)
            caps[picked] = self.budget.caps([req_ids[i] for i in picked.tolist()], room)
        if self.ngram is not None:
            if caps.any():
                self._propose_ngram(batch, req_ids, slots, caps)
            return
        assert self.draft_model is not None
        ends = np.where(sampled, batch.num_tokens[slots], seq_lens)
        proposal = self.draft_model.propose(batch, slots, starts, ends, caps)
        for i in np.flatnonzero(caps).tolist():
            drafts = proposal.draft_token_ids[i]
            if drafts:
                self._drafts[req_ids[i]] = drafts
                q = proposal.draft_probs[i]
                if q is not None:
                    self._draft_probs[req_ids[i]] = q

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """The measured time of a target step of ``num_tokens`` tokens (the budget's cost fit)."""
        self.budget.observe_step(num_tokens, seconds)

    def _room(self, batch: InputBatch, slot: int) -> int:
        """Drafts that can still be kept: the bonus token takes one of the tokens left."""
        params = batch.sampling_params[slot]
        num_tokens = int(batch.num_tokens[slot])
        room = self.max_model_len - num_tokens - 1
        if params is not None and params.max_tokens is not None:
            num_output = num_tokens - int(batch.num_prompt_tokens[slot])
            room = min(room, params.max_tokens - num_output - 1)
        return max(room, 0)

    def _propose_ngram(
        self, batch: InputBatch, req_ids: list[str], slots: np.ndarray, caps: np.ndarray
    ) -> None:
        """One lookup over the proposing rows, cut to the columns they use."""
        assert self.ngram is not None
        rows = np.flatnonzero(caps)
        picked = slots[rows]
        lengths = batch.num_tokens[picked]
        tokens = batch.token_ids[:, : int(lengths.max())][picked]
        drafts = self.ngram.propose(tokens, lengths, caps[rows])
        for i, proposed in zip(rows.tolist(), drafts, strict=True):
            if proposed:
                self._drafts[req_ids[i]] = proposed

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        """The drafts proposed after the latest step (each request's at most once)."""
        drafts, self._drafts = self._drafts, {}
        return drafts

    def forget(self, req_id: str) -> None:
        """A finished request: drop its budget and any pending draft distribution."""
        self.budget.forget(req_id)
        self._draft_probs.pop(req_id, None)
