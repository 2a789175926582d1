"""Drafting with a second, smaller model run in the same engine core.

The draft model has its own paged KV cache with the target's block ids: a
token at position ``p`` of a request is stored, for both models, in the slot
the target's block table gives it, so the scheduler's allocation, prefix
caching and preemption govern both caches at once. Each step, after the
target has verified, the draft runs twice over:

1. **catch-up + first draft**, one forward pass over every scheduled request:
   the tokens the target computed this step that were kept (its prompt chunk,
   or its last token and accepted drafts) plus the token just sampled, so the
   draft's KV covers every kept token. Rejected drafts are left out; their
   slots are rewritten when those positions are computed again. A request
   that does not draft this step (partial prefill, no budget) still takes
   part, so that its KV stays in step with the target's, which prefix-cache
   hits on its blocks rely on.
2. **k - 1 single-token passes** for the requests that draft, each feeding
   the previous draft.

Drafts beyond the blocks the target allocated so far have no slot of their
own yet: their KV goes to per-batch-slot scratch blocks past the target's
block ids (``scratch_blocks_per_slot`` each), which only this proposal reads.

Greedy requests draft the argmax. Random ones draft from the draft model's
distribution shaped by the request's temperature, min-p, top-k and top-p
(``target_probs.shaped_probs``), drawn with the request's own generator, and
hand that distribution to the verifier for rejection sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenloom.config import ModelConfig, SpeculativeConfig
from tokenloom.model.attention import AttentionMetadata
from tokenloom.model.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block
from tokenloom.model_loader.loader import load_model
from tokenloom.worker.input_batch import InputBatch
from tokenloom.worker.sampler import draw_uniform, greedy_tokens
from tokenloom.worker.spec_decode.target_probs import shaped_probs
from tokenloom.worker.step_inputs import to_device
from tokenloom.worker.top_k_top_p import inverse_cdf


@dataclass
class DraftProposal:
    """Per proposing row: its drafts, and their distributions ``[len, V]`` (None:
    greedy, whose drafts are verified by exact match)."""

    draft_token_ids: list[list[int]]
    draft_probs: list[torch.Tensor | None]


class DraftModelProposer:
    """Owns the draft model and its KV cache; see the module docstring."""

    def __init__(
        self,
        config: SpeculativeConfig,
        target_config: ModelConfig,
        target_vocab_size: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        generator: torch.Generator | None = None,
    ) -> None:
        assert config.model is not None
        loaded = load_model(
            ModelConfig(
                model=config.model,
                dtype=target_config.dtype,
                device=target_config.device,
                seed=target_config.seed,
            )
        )
        arch = loaded.arch
        if arch.vocab_size != target_vocab_size:
            raise ValueError(
                f"speculative_config.model has a vocabulary of {arch.vocab_size} tokens, the "
                f"target {target_vocab_size}: the draft model must share the target's tokenizer"
            )
        if arch.max_position_embeddings < max_model_len:
            raise ValueError(
                f"speculative_config.model handles {arch.max_position_embeddings} positions, "
                f"fewer than max_model_len ({max_model_len}); lower max_model_len"
            )
        self.model = loaded.model
        self.arch = arch
        self.device = loaded.device
        self.k = config.num_speculative_tokens
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.dtype = loaded.dtype
        self.max_num_seqs = max_num_seqs
        self.scratch_blocks_per_slot = -(-self.k // block_size) + 1
        # Allocated by ``allocate_kv_cache`` once the target's block count is known.
        self.num_target_blocks = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.forward_plan = loaded.plan
        self.native_attention = loaded.attention_op
        self.generator = generator

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes the draft's KV cache adds per target block (its own copy of the block)."""
        return kv_cache_bytes_per_block(self.arch, self.block_size, self.dtype)

    @property
    def kv_scratch_bytes(self) -> int:
        """Bytes of the scratch blocks, whatever the target's block count."""
        return self.max_num_seqs * self.scratch_blocks_per_slot * self.kv_bytes_per_block

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The draft KV cache for a target cache of ``num_blocks`` blocks, plus scratch."""
        self.num_target_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(
            self.arch,
            num_blocks + self.max_num_seqs * self.scratch_blocks_per_slot,
            self.block_size,
            self.dtype,
            self.device,
        )

    @torch.inference_mode()
    def propose(
        self,
        batch: InputBatch,
        slots: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        caps: np.ndarray,
    ) -> DraftProposal:
        """Catch up and draft for the requests at ``slots`` (this step's, any order).

        Row ``i`` computes tokens ``starts[i] .. ends[i] - 1`` of its request (held in
        ``batch.token_ids``) and drafts up to ``caps[i]`` tokens after them (0: catch
        up only); drafts stop below ``max_model_len``.
        """
        num = len(slots)
        caps = np.minimum(np.minimum(caps, self.k), np.maximum(self.max_model_len - ends, 0))
        table = self._block_table(batch, slots, int((ends + caps).max()))
        query_lens = ends - starts
        cu = np.cumsum(query_lens)
        positions = np.arange(int(cu[-1]), dtype=np.int64) + np.repeat(
            starts - (cu - query_lens), query_lens
        )
        input_ids = batch.token_ids[np.repeat(slots, query_lens), positions].astype(np.int64)
        hidden = self._forward(input_ids, positions, np.arange(num), query_lens, ends, table)

        drafts: list[list[int]] = [[] for _ in range(num)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(num)]
        active = np.flatnonzero(caps > 0)
        if active.size:
            hidden = hidden.index_select(0, torch.from_numpy(active).to(self.device))
        step = 0
        while active.size:
            tokens = self._sample(hidden, batch, slots[active], active, probs)
            for i, token in zip(active.tolist(), tokens.tolist(), strict=True):
                drafts[i].append(token)
            step += 1
            more = caps[active] > step
            active, tokens = active[more], tokens[more]
            if not active.size:
                break
            # Feed each draft at the position after the previous one.
            positions = ends[active] - 1 + step
            ones = np.ones(len(active), np.int64)
            hidden = self._forward(tokens, positions, active, ones, positions + 1, table)
        return DraftProposal(drafts, [torch.stack(p) if p else None for p in probs])

    def _block_table(self, batch: InputBatch, slots: np.ndarray, max_end: int) -> np.ndarray:
        """The target's block table rows for ``slots``, continued with scratch blocks."""
        num_cols = -(-max_end // self.block_size)
        width = min(num_cols, batch.block_table.shape[1])
        table = np.zeros((len(slots), num_cols), np.int64)
        table[:, :width] = batch.block_table[slots, :width]
        extra = np.arange(num_cols)[None, :] - batch.num_blocks[slots][:, None]
        scratch = (
            self.num_target_blocks
            + slots[:, None] * self.scratch_blocks_per_slot
            + np.minimum(extra, self.scratch_blocks_per_slot - 1)
        )
        return np.where(extra >= 0, scratch, table)

    def _forward(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        rows: np.ndarray,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        table: np.ndarray,
    ) -> torch.Tensor:
        """One pass of requests ``rows`` (rows of ``table``); hidden state at each one's
        last token."""
        bs = self.block_size
        token_rows = np.repeat(rows, query_lens)
        slot_mapping = table[token_rows, positions // bs] * bs + positions % bs
        device = self.device
        block_table = to_device(table[rows].astype(np.int32), device)
        slots = to_device(slot_mapping.astype(np.int64), device)
        if self.forward_plan.attention == "triton":  # as the target's steps on CUDA
            query_start = np.zeros(len(rows) + 1, dtype=np.int32)
            np.cumsum(query_lens, out=query_start[1:])
            meta = AttentionMetadata.for_kernel(
                to_device(query_start, device),
                to_device(seq_lens.astype(np.int32), device),
                block_table,
                slots,
                bs,
            )
        else:
            meta = AttentionMetadata.build(
                query_lens.tolist(),
                seq_lens.tolist(),
                block_table,
                slots,
                bs,
                native_op=self.native_attention,
            )
        hidden = self.model(
            to_device(input_ids.astype(np.int64), device),
            to_device(positions.astype(np.int64), device),
            self.kv_caches,
            meta,
        )
        return hidden.index_select(0, to_device(np.cumsum(query_lens) - 1, device))

    def _sample(
        self,
        hidden: torch.Tensor,
        batch: InputBatch,
        slots: np.ndarray,
        rows: np.ndarray,
        probs: list[list[torch.Tensor]],
    ) -> np.ndarray:
        """One draft per row: argmax for greedy requests, else a draw from the shaped
        draft distribution (kept in ``probs[row]`` for the verifier)."""
        logits = self.model.compute_logits(hidden)
        tokens = greedy_tokens(logits)
        temperature = batch.temperature[slots]
        random = np.flatnonzero(temperature > 0.0)
        if random.size:
            device = self.device
            picked = slots[random]
            top_k, top_p, min_p = batch.top_k[picked], batch.top_p[picked], batch.min_p[picked]
            q = shaped_probs(
                logits.index_select(0, to_device(random, device)),
                to_device(temperature[random], device),
                to_device(top_k, device) if (top_k < batch.vocab_size).any() else None,
                to_device(top_p, device) if (top_p < 1.0).any() else None,
                to_device(min_p, device) if (min_p > 0.0).any() else None,
            )
            generators = {
                i: batch.generators[int(s)]
                for i, s in enumerate(picked.tolist())
                if s in batch.generators
            }
            u = draw_uniform(len(random), generators, self.generator, device)
            tokens[to_device(random, device)] = inverse_cdf(q, u)
            for i, row in enumerate(rows[random].tolist()):
                probs[row].append(q[i])
        return tokens.cpu().numpy()
