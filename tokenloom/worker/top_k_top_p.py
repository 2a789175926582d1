"""Top-k / top-p (nucleus) truncation, then the exponential race, fast.

A full sort of the vocabulary per row is the simple way and the slow one
(tens of milliseconds for a batch on a CPU). Usually the kept set is small, so
rows are sampled among their ``K`` best candidates (one partial ``topk``):

- a row with top-k ``k <= K`` keeps a subset of its candidates by definition;
- a row with top-p only keeps its nucleus, which lies inside the candidates
  when their probability mass (normalised over the whole vocabulary) reaches p.

Any other row (top-k above ``MAX_CANDIDATES``, or a nucleus wider than the
candidates) takes the exact full-sort path. Both paths keep the same tokens
(up to ties at the k-th logit) and race with the same per-token noise, so the
path a row takes never changes its distribution or its seeded stream.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")
MAX_CANDIDATES = 1024
# Candidates tried for rows with top-p only before falling back to a full sort.
NUCLEUS_CANDIDATES = 256


def sample_top_k_top_p(
    logits: torch.Tensor,
    log_noise: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
) -> torch.Tensor:
    """One token per row from softmax(logits) truncated by top-k then top-p.

    ``top_k`` values >= vocab and ``top_p`` values of 1 mean off for that row.
    ``log_noise`` is log E, E ~ Exp(1), one per logit.
    """
    num_rows, vocab = logits.shape
    k = torch.full((num_rows,), vocab, dtype=torch.long, device=logits.device)
    if top_k is not None:
        k = top_k.clamp(max=vocab)
    p = torch.ones(num_rows, dtype=logits.dtype, device=logits.device)
    if top_p is not None:
        p = top_p.to(logits.dtype)

    sampled = (logits - log_noise).argmax(dim=-1)  # right for untruncated rows
    small_k = k <= MAX_CANDIDATES
    nucleus_only = (k >= vocab) & (p < 1.0)
    fast = small_k | nucleus_only
    rows = fast.nonzero().squeeze(1)
    valid = torch.ones(0, dtype=torch.bool, device=logits.device)
    if rows.numel():
        tokens, valid = _sample_candidates(
            logits.index_select(0, rows),
            log_noise.index_select(0, rows),
            k.index_select(0, rows),
            p.index_select(0, rows),
            small_k.index_select(0, rows),
        )
        sampled[rows[valid]] = tokens[valid]
    slow = ~fast & ((k < vocab) | (p < 1.0))
    slow[rows[~valid]] = True
    slow_rows = slow.nonzero().squeeze(1)
    if slow_rows.numel():
        masked = apply_top_k_top_p(
            logits.index_select(0, slow_rows),
            k.index_select(0, slow_rows),
            p.index_select(0, slow_rows),
        )
        race = masked - log_noise.index_select(0, slow_rows)
        sampled[slow_rows] = race.argmax(dim=-1)
    return sampled


def _sample_candidates(
    logits: torch.Tensor,
    log_noise: torch.Tensor,
    k: torch.Tensor,
    p: torch.Tensor,
    small_k: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Race among each row's best candidates; returns (tokens, valid per row)."""
    vocab = logits.shape[1]
    width = int(k[small_k].max()) if bool(small_k.any()) else 0
    if not bool(small_k.all()):
        width = max(width, NUCLEUS_CANDIDATES)
    width = min(width, vocab)
    values, ids = logits.topk(width, dim=-1)  # descending
    position = torch.arange(width, device=logits.device)
    values.masked_fill_(position[None, :] >= k[:, None], _NEG_INF)
    # Normalise over the top-k set where it fits, else over the whole vocabulary.
    log_total = torch.where(small_k, values.logsumexp(dim=-1), logits.logsumexp(dim=-1)).unsqueeze(
        1
    )
    probs = (values - log_total).exp()
    mass = probs.cumsum(dim=-1)
    keep = (mass - probs) < p[:, None]
    valid = small_k | (mass[:, -1] >= p)
    values.masked_fill_(~keep, _NEG_INF)
    choice = (values - log_noise.gather(1, ids)).argmax(dim=-1, keepdim=True)
    return ids.gather(1, choice).squeeze(1), valid


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Exact masking by full sort: keep each row's k best tokens, then the smallest
    set reaching mass p (the top token always stays). Ties at the k-th logit stay."""
    vocab = logits.shape[-1]
    ascending, order = logits.sort(dim=-1)
    kth = ascending.gather(1, (vocab - k.clamp(min=1, max=vocab)).unsqueeze(1))
    ascending.masked_fill_(ascending < kth, _NEG_INF)
    # Token j (ascending) goes when it and everything below it hold <= 1 - p,
    # i.e. the tokens above it already reach p.
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1.0 - p).unsqueeze(1)
    drop[:, -1] = False
    ascending.masked_fill_(drop, _NEG_INF)
    return logits.scatter_(1, order, ascending)
