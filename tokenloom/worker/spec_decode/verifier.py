"""Batched verification of draft tokens against the target model's logits.

Rows come grouped per request (``num_drafts[g]`` draft rows, then its bonus
row), as the runner lays them out. Two rules, both exact:

* **Exact match** (drafts without a distribution: n-gram lookups, and every
  greedy request): each row is sampled by the normal sampler with the
  request's parameters and generator, and drafts are kept while they equal
  the row's sample; the sample at the first mismatch (or after the last
  draft) ends the list. Every kept token is the target's own sample given the
  kept prefix, so the output follows the target distribution; for a one-hot
  proposal this accepts a draft with probability ``p(draft)``, the same as
  rejection sampling would.
* **Rejection sampling** (random requests whose drafts came with the draft
  model's distribution ``q``): ``rejection_sampler.rejection_sample`` on the
  target's processed distribution (``target_probs``), which accepts with
  ``min(1, p / q)`` and so keeps more drafts than exact matching when ``q``
  resembles ``p``.

Logprobs, when asked for, describe the raw logits at each kept row, as for
plain decoding.

A seeded request's generator ends the step advanced by one draw per token it
kept, as in plain decoding (draws for rows past the first mismatch are taken
back). How many drafts a request gets depends on measured step times
(``draft_budget``), so without this its random stream, and with exact matching
its tokens, would change from run to run; with it, a seeded request with
n-gram drafts makes the draws it would make without speculation, and so
samples the same tokens up to the last bits of its logits (a verified row's
float32 logits come from other matmul shapes than a plain decode row's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenloom.outputs import TokenLogprobs
from tokenloom.worker.sampler import (
    RawLogprobs,
    Sampler,
    apply_penalties,
    draw_uniform,
    skip_draws,
)
from tokenloom.worker.sampling_metadata import SamplingMetadata
from tokenloom.worker.spec_decode.rejection_sampler import VerifyInputs, rejection_sample
from tokenloom.worker.spec_decode.target_probs import shaped_probs

_NEG_INF = float("-inf")


@dataclass
class Verified:
    """Per request (group): kept drafts + one token, and their logprobs."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None] | None


def verify(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    sampler: Sampler,
    draft_token_ids: list[list[int]],
    draft_probs: list[torch.Tensor | None] | None = None,
) -> Verified:
    """Verify ``draft_token_ids[g]`` (possibly empty) for each group of rows.

    ``logits`` [R, V] (R = sum of len(drafts) + 1) is consumed. ``draft_probs[g]``
    is the draft model's ``[len(drafts), V]`` distribution for group ``g`` or None.
    """
    num_drafts = np.fromiter((len(d) for d in draft_token_ids), np.int64, len(draft_token_ids))
    group_start = np.cumsum(num_drafts + 1) - (num_drafts + 1)
    num_rows = int(num_drafts.sum()) + len(num_drafts)
    if logits.shape[0] != num_rows:
        raise ValueError(f"{logits.shape[0]} logits rows for {num_rows} verification rows")
    greedy_rows = (metadata.temperature == 0.0).cpu().numpy()
    saved_streams = {
        g: (generator, generator.get_state())
        for g, start in enumerate(group_start.tolist())
        if num_drafts[g] and (generator := metadata.generators.get(start)) is not None
    }
    dense = [
        g
        for g in range(len(num_drafts))
        if draft_probs is not None
        and draft_probs[g] is not None
        and num_drafts[g] > 0
        and not greedy_rows[group_start[g]]
    ]
    processed = raw = None
    if dense:
        processed = _process_logits(logits.clone(), metadata)
        if metadata.num_logprobs is not None:
            raw = RawLogprobs.capture(logits, metadata.num_logprobs)

    # Exact match for everyone (dense groups are overwritten below): one sample per row.
    sampled = sampler(logits, metadata)
    row_tokens = sampled.sampled_token_ids
    drafts_flat = np.zeros(num_rows, np.int64)
    for g, drafts in enumerate(draft_token_ids):
        if drafts:
            drafts_flat[group_start[g] : group_start[g] + len(drafts)] = drafts
    k_max = int(num_drafts.max()) if len(num_drafts) else 0
    num_accepted = np.zeros(len(num_drafts), np.int64)
    if k_max:
        match = row_tokens.cpu().numpy() == drafts_flat
        offsets = np.arange(k_max)
        rows = np.minimum(group_start[:, None] + offsets[None, :], num_rows - 1)
        valid = offsets[None, :] < num_drafts[:, None]
        num_accepted = np.cumprod(match[rows] & valid, axis=1).sum(axis=1)

    tokens_np = row_tokens.cpu().numpy()
    token_ids = [
        tokens_np[start : start + count + 1].tolist()
        for start, count in zip(group_start.tolist(), num_accepted.tolist(), strict=True)
    ]
    if dense:
        assert processed is not None and draft_probs is not None
        _rejection_groups(
            dense, processed, metadata, sampler, draft_token_ids, draft_probs,
            group_start, token_ids, row_tokens,
        )  # fmt: skip

    for g, (generator, state) in saved_streams.items():
        generator.set_state(state)
        skip_draws(generator, len(token_ids[g]))

    logprobs = None
    if sampled.logprobs is not None:
        # Logprobs were gathered at the exact-match samples; redo the rows that changed.
        entries = sampled.logprobs if raw is None else raw.gather(row_tokens)
        logprobs = []
        for start, tokens in zip(group_start.tolist(), token_ids, strict=True):
            kept = entries[start : start + len(tokens)]
            logprobs.append(None if kept[0] is None else [e for e in kept if e is not None])
    return Verified(token_ids, logprobs)


def _process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Banned tokens and penalties, as the sampler applies them before anything else."""
    if metadata.banned_rows is not None:
        logits[metadata.banned_rows, metadata.banned_token_ids] = _NEG_INF
    if not metadata.no_penalties:
        logits = apply_penalties(logits, metadata)
    return logits


def _rejection_groups(
    groups: list[int],
    processed: torch.Tensor,
    metadata: SamplingMetadata,
    sampler: Sampler,
    draft_token_ids: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    group_start: np.ndarray,
    token_ids: list[list[int]],
    row_tokens: torch.Tensor,
) -> None:
    """Replace the exact-match results of ``groups`` by rejection sampling."""
    device = processed.device
    rows_list: list[int] = []
    q_parts: list[torch.Tensor] = []
    drafts: list[int] = []
    for g in groups:
        start, count = int(group_start[g]), len(draft_token_ids[g])
        rows_list.extend(range(start, start + count + 1))
        q = draft_probs[g]
        assert q is not None
        q_parts.append(q[:count].to(processed.dtype))
        q_parts.append(processed.new_zeros(1, processed.shape[1]))
        drafts.extend(draft_token_ids[g])
        drafts.append(0)
    rows = torch.tensor(rows_list, dtype=torch.long, device=device)

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, rows)

    target = shaped_probs(
        processed.index_select(0, rows),
        metadata.temperature.index_select(0, rows),
        pick(metadata.top_k),
        pick(metadata.top_p),
        pick(metadata.min_p),
    )
    position = {row: i for i, row in enumerate(rows_list)}
    accept_gens = {position[r]: gen for r, gen in metadata.generators.items() if r in position}
    bonus_rows = [int(group_start[g]) + len(draft_token_ids[g]) for g in groups]
    recovery_gens = {
        i: metadata.generators[r] for i, r in enumerate(bonus_rows) if r in metadata.generators
    }
    out = rejection_sample(
        VerifyInputs(
            target_probs=target,
            draft_token_ids=torch.tensor(drafts, dtype=torch.long, device=device),
            draft_probs=torch.cat(q_parts),
            num_drafts=torch.tensor([len(draft_token_ids[g]) for g in groups]),
            greedy=torch.zeros(len(groups), dtype=torch.bool),
            accept_uniforms=draw_uniform(len(rows_list), accept_gens, sampler.generator, device),
            recovery_uniforms=draw_uniform(len(groups), recovery_gens, sampler.generator, device),
        )
    )
    for g, tokens in zip(groups, out, strict=True):
        token_ids[g] = tokens
        start = int(group_start[g])
        row_tokens[start : start + len(tokens)] = torch.tensor(tokens, device=row_tokens.device)
