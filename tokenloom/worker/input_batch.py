"""The persistent batch: per-request state kept across steps, indexed by slot.

Requests live in preallocated arrays (token ids, block table, sampling
parameters), so a step only applies what changed: requests that join or leave,
new blocks, sampled tokens. Slots are kept dense (``0 .. num_reqs - 1``): a
removed request leaves a hole that a joining request fills, and ``condense``
moves the last requests into any holes left.

A preempted request leaves the batch but its prompt, sampling parameters and
generator are kept, so that it resumes with the same random stream; the
scheduler resends its output tokens and full block list when it resumes.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from tokenloom.sampling_params import SamplingParams
from tokenloom.worker.sampler import skip_draws

_SEED_MASK = (1 << 64) - 1


@dataclass
class _Stashed:
    """What a preempted request needs to rejoin the batch."""

    prompt_token_ids: np.ndarray
    sampling_params: SamplingParams
    generator: torch.Generator | None
    stopping_token_ids: tuple[int, ...]


class InputBatch:
    """Dense per-slot arrays for up to ``max_num_seqs`` requests."""

    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.max_blocks_per_req = -(-max_model_len // block_size)

        # One spare column: a verified draft step may end one token past max_model_len
        # (the scheduler then finishes the request).
        self.token_ids = np.zeros((max_num_seqs, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)  # prompt + output
        self.num_prompt_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_seqs, self.max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)

        self.temperature = np.zeros(max_num_seqs, dtype=np.float32)
        self.top_p = np.ones(max_num_seqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_seqs, dtype=np.int64)  # vocab_size when off
        self.min_p = np.zeros(max_num_seqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_seqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_seqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_seqs, dtype=np.float32)
        self.num_logprobs = np.full(max_num_seqs, -1, dtype=np.int64)
        self.min_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        # No penalties, no min_tokens, no logprobs: sampling reads nothing but the
        # logits and the temperature/top-k/top-p/min-p above.
        self.plain = np.zeros(max_num_seqs, dtype=bool)
        # The request's stopping token ids within the vocabulary, sorted: banned
        # while fewer than min_tokens outputs exist.
        self.stopping_token_ids: list[tuple[int, ...]] = [()] * max_num_seqs
        self.sampling_params: list[SamplingParams | None] = [None] * max_num_seqs
        self.generators: dict[int, torch.Generator] = {}

        self.req_ids: list[str | None] = [None] * max_num_seqs
        self.req_id_to_index: dict[str, int] = {}
        self._holes: list[int] = []  # heap of free slots below num_slots
        self.num_slots = 0  # one past the highest slot in use (== num_reqs after condense)
        self._stashed: dict[str, _Stashed] = {}

    # ------------------------------------------------------------------ membership

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int] | np.ndarray,
        sampling_params: SamplingParams,
        block_ids: list[int],
        num_computed_tokens: int,
        output_token_ids: list[int] | None = None,
        generator: torch.Generator | None = None,
        stopping_token_ids: Iterable[int] = (),
    ) -> int:
        """Place a request in the lowest free slot; returns the slot.

        ``generator`` continues a preempted request's random stream; a new seeded
        request gets a fresh one from ``sampling_params.seed``, advanced past the
        draws of its ``output_token_ids`` when it brings some (a request resumed
        after an engine crash), so its stream continues where it stopped.
        ``stopping_token_ids`` are ``Request.stopping_token_ids`` (see
        :func:`tokenloom.request.stopping_token_ids`), banned until min_tokens.
        """
        if req_id in self.req_id_to_index:
            raise ValueError(f"request {req_id!r} is already in the batch")
        num_prompt = len(prompt_token_ids)
        outputs = output_token_ids or []
        num_tokens = num_prompt + len(outputs)
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"request {req_id!r} has {num_tokens} tokens, more than max_model_len "
                f"({self.max_model_len})"
            )
        if self._holes:
            slot = heapq.heappop(self._holes)
        elif self.num_slots < self.max_num_seqs:
            slot = self.num_slots
            self.num_slots += 1
        else:
            raise ValueError(f"batch is full (max_num_seqs={self.max_num_seqs})")

        self.req_ids[slot] = req_id
        self.req_id_to_index[req_id] = slot
        row = self.token_ids[slot]
        row[:num_prompt] = prompt_token_ids
        row[num_prompt:num_tokens] = outputs
        self.num_tokens[slot] = num_tokens
        self.num_prompt_tokens[slot] = num_prompt
        self.num_computed_tokens[slot] = num_computed_tokens
        self.num_blocks[slot] = 0
        self.append_block_ids(slot, block_ids)

        sp = sampling_params
        self.sampling_params[slot] = sp
        self.temperature[slot] = sp.temperature
        self.top_p[slot] = sp.top_p
        self.top_k[slot] = sp.top_k if sp.top_k > 0 else self.vocab_size
        self.min_p[slot] = sp.min_p
        self.presence_penalty[slot] = sp.presence_penalty
        self.frequency_penalty[slot] = sp.frequency_penalty
        self.repetition_penalty[slot] = sp.repetition_penalty
        self.num_logprobs[slot] = -1 if sp.logprobs is None else sp.logprobs
        self.min_tokens[slot] = sp.min_tokens
        self.plain[slot] = (
            sp.presence_penalty == 0.0
            and sp.frequency_penalty == 0.0
            and sp.repetition_penalty == 1.0
            and sp.min_tokens == 0
            and sp.logprobs is None
        )
        vocab = self.vocab_size
        self.stopping_token_ids[slot] = tuple(sorted(t for t in stopping_token_ids if t < vocab))
        if generator is None and sp.seed is not None and sp.temperature > 0:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(sp.seed & _SEED_MASK)
            skip_draws(generator, len(outputs))
        if generator is not None:
            self.generators[slot] = generator
        return slot

    def remove_request(self, req_id: str) -> int | None:
        """Drop a request (finished or aborted); returns its old slot, None if unknown."""
        self._stashed.pop(req_id, None)
        slot = self.req_id_to_index.pop(req_id, None)
        if slot is None:
            return None
        self.req_ids[slot] = None
        self.sampling_params[slot] = None
        self.generators.pop(slot, None)
        heapq.heappush(self._holes, slot)
        return slot

    def preempt_request(self, req_id: str) -> None:
        """Leave the batch but keep what is needed to resume (see ``resume_request``)."""
        slot = self.req_id_to_index.get(req_id)
        if slot is None:
            return
        sp = self.sampling_params[slot]
        assert sp is not None
        stash = _Stashed(
            prompt_token_ids=self.token_ids[slot, : self.num_prompt_tokens[slot]].copy(),
            sampling_params=sp,
            generator=self.generators.get(slot),
            stopping_token_ids=self.stopping_token_ids[slot],
        )
        self.remove_request(req_id)
        self._stashed[req_id] = stash

    def resume_request(
        self,
        req_id: str,
        output_token_ids: list[int],
        block_ids: list[int],
        num_computed_tokens: int,
    ) -> int:
        """Rejoin after preemption with the scheduler's outputs and full block list."""
        stash = self._stashed.pop(req_id, None)
        if stash is None:
            raise ValueError(f"resumed request {req_id!r} was never preempted from this batch")
        return self.add_request(
            req_id,
            stash.prompt_token_ids,
            stash.sampling_params,
            block_ids,
            num_computed_tokens,
            output_token_ids=output_token_ids,
            generator=stash.generator,
            stopping_token_ids=stash.stopping_token_ids,
        )

    def condense(self) -> None:
        """Move the last requests into the holes so slots ``0 .. num_reqs - 1`` are used."""
        holes = sorted(self._holes)
        self._holes = []
        last = self.num_slots - 1
        for hole in holes:
            while last > hole and self.req_ids[last] is None:
                last -= 1
            if last <= hole:
                break
            self._move(last, hole)
            last -= 1
        self.num_slots = self.num_reqs

    def _move(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        assert req_id is not None
        n = int(self.num_tokens[src])
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        nb = int(self.num_blocks[src])
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        for array in (
            self.num_tokens,
            self.num_prompt_tokens,
            self.num_computed_tokens,
            self.num_blocks,
            self.temperature,
            self.top_p,
            self.top_k,
            self.min_p,
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
            self.num_logprobs,
            self.min_tokens,
            self.plain,
        ):
            array[dst] = array[src]
        self.sampling_params[dst] = self.sampling_params[src]
        self.sampling_params[src] = None
        self.stopping_token_ids[dst] = self.stopping_token_ids[src]
        generator = self.generators.pop(src, None)
        if generator is not None:
            self.generators[dst] = generator
        self.req_ids[dst] = req_id
        self.req_ids[src] = None
        self.req_id_to_index[req_id] = dst

    # ------------------------------------------------------------------ per-step updates

    def append_block_ids(self, slot: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[slot])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise ValueError(
                f"request {self.req_ids[slot]!r} would hold {end} blocks, more than "
                f"max_model_len allows ({self.max_blocks_per_req})"
            )
        self.block_table[slot, start:end] = block_ids
        self.num_blocks[slot] = end

    def append_token(self, slots: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one token to each of ``slots`` (distinct), vectorised."""
        self.token_ids[slots, self.num_tokens[slots]] = token_ids
        self.num_tokens[slots] += 1

    def append_tokens(self, slot: int, token_ids: list[int]) -> None:
        n = int(self.num_tokens[slot])
        end = min(n + len(token_ids), self.token_ids.shape[1])
        self.token_ids[slot, n:end] = token_ids[: end - n]
        self.num_tokens[slot] = end

    def get_token_ids(self, req_id: str) -> list[int]:
        """Prompt + output tokens of a request (for tests and debugging)."""
        slot = self.req_id_to_index[req_id]
        return self.token_ids[slot, : self.num_tokens[slot]].tolist()

    def get_block_ids(self, req_id: str) -> list[int]:
        slot = self.req_id_to_index[req_id]
        return self.block_table[slot, : self.num_blocks[slot]].tolist()

    def is_stashed(self, req_id: str) -> bool:
        return req_id in self._stashed
