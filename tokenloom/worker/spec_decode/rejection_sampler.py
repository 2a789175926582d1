"""Verifying draft tokens so that the output follows the target model exactly.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): draft ``d_i``
proposed with probability ``q_i(d_i)`` is accepted with probability
``min(1, p_i(d_i) / q_i(d_i))`` where ``p_i`` is the target's (processed)
distribution at that position; at the first rejection the token is drawn
from the residual ``max(p_i - q_i, 0)`` (normalised) and the step ends; when
all drafts are accepted a bonus token is drawn from the target's next
position. Every emitted token is then distributed as the target's, whatever
``q`` was. Drafts without a distribution (n-gram lookups) are one-hot
proposals: ``q_i(d_i) = 1``. Greedy requests accept a draft iff it is the
target's argmax and emit the argmax at the first mismatch.

Rows come grouped per request: ``k`` draft rows followed by the bonus row.
Uniforms are supplied by the caller (one per row, from each request's own
generator), so seeded requests stay deterministic whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.worker.sampler import greedy_tokens
from tokenloom.worker.top_k_top_p import inverse_cdf


@dataclass
class VerifyInputs:
    """One step's verification problem, rows grouped per request.

    ``target_probs`` [R, V]: the target's processed distribution at each row.
    ``draft_token_ids`` [R] int64: the draft verified at each row (ignored on
    bonus rows). ``draft_probs`` [R, V] or None for one-hot drafts.
    ``num_drafts`` [G]: drafts per request (its rows are ``num_drafts + 1``).
    ``greedy`` [G] bool. ``accept_uniforms`` [R] and ``recovery_uniforms`` [G]:
    float64 in [0, 1), independent (a rejection must not bias the recovery draw).
    """

    target_probs: torch.Tensor
    draft_token_ids: torch.Tensor
    draft_probs: torch.Tensor | None
    num_drafts: torch.Tensor
    greedy: torch.Tensor
    accept_uniforms: torch.Tensor
    recovery_uniforms: torch.Tensor


def rejection_sample(inputs: VerifyInputs) -> list[list[int]]:
    """Per request: its accepted drafts followed by one recovered or bonus token."""
    p = inputs.target_probs
    device = p.device
    num_rows = p.shape[0]
    num_drafts = inputs.num_drafts.to(device=device, dtype=torch.long)
    group_start = torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)
    greedy = inputs.greedy.to(device=device, dtype=torch.bool)

    drafts = inputs.draft_token_ids.to(device=device, dtype=torch.long).clamp(min=0)
    p_draft = p.gather(1, drafts[:, None]).squeeze(1)
    if inputs.draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = inputs.draft_probs.gather(1, drafts[:, None]).squeeze(1)
    argmax = greedy_tokens(p)
    # u < p/q, written without the division (q may be 0 where p is not).
    random_accept = inputs.accept_uniforms.to(device=device, dtype=p.dtype) * q_draft < p_draft
    greedy_accept = drafts == argmax

    # [G, k_max] view of each request's draft rows; accepted = leading run of accepts.
    k_max = int(num_drafts.max()) if num_drafts.numel() else 0
    offsets = torch.arange(max(k_max, 1), device=device)
    rows = (group_start[:, None] + offsets[None, :]).clamp_(max=num_rows - 1)
    valid = offsets[None, :] < num_drafts[:, None]
    accept = torch.where(greedy[:, None], greedy_accept[rows], random_accept[rows]) & valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)

    last_rows = group_start + num_accepted
    final_p = p.index_select(0, last_rows)
    is_bonus = num_accepted == num_drafts
    if inputs.draft_probs is None:
        residual = final_p.scatter(1, drafts.index_select(0, last_rows)[:, None], 0.0)
    else:
        residual = (final_p - inputs.draft_probs.index_select(0, last_rows)).clamp_(min=0.0)
    weights = torch.where(is_bonus[:, None], final_p, residual)
    # A residual is all zeros only where p == q, where rejection has probability 0.
    empty = weights.sum(dim=-1) <= 0
    weights = torch.where(empty[:, None], final_p, weights)
    sampled = inverse_cdf(weights, inputs.recovery_uniforms.to(device=device, dtype=torch.float64))
    last_tokens = torch.where(greedy, argmax.index_select(0, last_rows), sampled)

    drafts_list = inputs.draft_token_ids.tolist()
    starts = group_start.tolist()
    return [
        [*drafts_list[start : start + count], token]
        for start, count, token in zip(
            starts, num_accepted.tolist(), last_tokens.tolist(), strict=True
        )
    ]
