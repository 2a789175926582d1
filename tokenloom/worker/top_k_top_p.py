"""Top-k / top-p (nucleus) truncation and inverse-CDF sampling, fast.

Each random row is sampled by inverting its CDF at one uniform ``u`` drawn from
the row's generator: one random number per row and step, so a seeded row's
stream never depends on the batch, and no vocabulary-sized noise is drawn.
Untruncated rows walk the vocabulary in id order; truncated rows walk their
kept tokens from the most to the least likely, whichever path found them.

A full sort of the vocabulary per row is slow (tens of milliseconds for a
batch on a CPU) and usually unnecessary, so truncated rows are first tried
among their ``K`` best candidates (one partial ``topk``):

- a row with top-k ``k <= MAX_CANDIDATES`` keeps a subset of its candidates;
- a row with top-p only keeps its nucleus, which lies inside the candidates
  when their probability mass (normalised over the whole vocabulary) reaches p.

Any other row takes the exact full-sort path, which keeps the same tokens in
the same order, so the path a row takes never changes what it samples.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")
MAX_CANDIDATES = 1024
# Candidates tried, in turn, for rows with top-p only before a full sort.
NUCLEUS_CANDIDATES = (256, 4096)
# The CDF of a wide row is inverted block by block, so float64 sums stay short.
_CDF_BLOCK = 256


def sample_top_k_top_p(
    logits: torch.Tensor,
    u: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
) -> torch.Tensor:
    """One token per row from softmax(logits) truncated by top-k then top-p.

    ``top_k`` values >= vocab and ``top_p`` values of 1 mean off for that row;
    ``u`` is one float64 uniform in [0, 1) per row.
    """
    num_rows, vocab = logits.shape
    k, p = row_limits(logits, top_k, top_p)

    truncated = (k < vocab) | (p < 1.0)
    sampled = torch.empty(num_rows, dtype=torch.long, device=logits.device)
    plain = (~truncated).nonzero().squeeze(1)
    if plain.numel():
        sampled[plain] = sample_full(logits.index_select(0, plain), u.index_select(0, plain))

    small_k = k <= MAX_CANDIDATES
    fast = truncated & (small_k | (p < 1.0) & (k >= vocab))
    rows = fast.nonzero().squeeze(1)
    slow = truncated & ~fast
    for nucleus_width in NUCLEUS_CANDIDATES:
        if not rows.numel():
            break
        tokens, valid = _sample_candidates(
            logits.index_select(0, rows),
            u.index_select(0, rows),
            k.index_select(0, rows),
            p.index_select(0, rows),
            small_k.index_select(0, rows),
            nucleus_width,
        )
        sampled[rows[valid]] = tokens[valid]
        rows = rows[~valid]
    slow[rows] = True
    slow_rows = slow.nonzero().squeeze(1)
    if slow_rows.numel():
        sampled[slow_rows] = _sample_sorted(
            logits.index_select(0, slow_rows),
            u.index_select(0, slow_rows),
            k.index_select(0, slow_rows),
            p.index_select(0, slow_rows),
        )
    return sampled


def row_limits(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row top-k in [1, vocab] and top-p in (0, 1], with "off" as vocab and 1."""
    num_rows, vocab = logits.shape
    k = torch.full((num_rows,), vocab, dtype=torch.long, device=logits.device)
    if top_k is not None:
        k = top_k.clamp(min=1, max=vocab)
    p = torch.ones(num_rows, dtype=logits.dtype, device=logits.device)
    if top_p is not None:
        p = top_p.to(logits.dtype)
    return k, p


def sample_full(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Rows of softmax(logits) sampled in token-id order."""
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    return inverse_cdf(shifted.exp_(), u)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index ``i`` per row with cdf[i - 1] <= u * total < cdf[i] (weights >= 0).

    Wide rows go in two stages (which block, then where in it) so every
    running sum is short and exact enough in float64, without a float64 copy
    of the whole row.
    """
    num_rows, width = weights.shape
    if width <= 4 * _CDF_BLOCK:
        cdf = weights.cumsum(dim=-1, dtype=torch.float64)
        target = (u * cdf[:, -1]).unsqueeze(1)
        return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=width - 1)
    full = width // _CDF_BLOCK
    block_sums = weights[:, : full * _CDF_BLOCK].reshape(num_rows, full, _CDF_BLOCK).sum(-1)
    if full * _CDF_BLOCK < width:
        tail = weights[:, full * _CDF_BLOCK :].sum(-1, keepdim=True)
        block_sums = torch.cat([block_sums, tail], dim=1)
    block_cdf = block_sums.cumsum(dim=-1, dtype=torch.float64)
    target = (u * block_cdf[:, -1]).unsqueeze(1)
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_sums.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    columns = block * _CDF_BLOCK + torch.arange(_CDF_BLOCK, device=weights.device)
    inside = columns < width
    values = weights.gather(1, columns.clamp(max=width - 1)) * inside
    cdf = values.cumsum(dim=-1, dtype=torch.float64)
    offset = torch.searchsorted(cdf, target - before, right=True).clamp_(max=_CDF_BLOCK - 1)
    # Float rounding between the two stages can point past the block's last kept token.
    last_kept = (values > 0).cumsum(-1).argmax(-1, keepdim=True)
    offset = torch.minimum(offset, last_kept)
    return columns.gather(1, offset).squeeze(1)


def _sample_candidates(
    logits: torch.Tensor,
    u: torch.Tensor,
    k: torch.Tensor,
    p: torch.Tensor,
    small_k: torch.Tensor,
    nucleus_width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample among each row's best candidates; returns (tokens, valid per row)."""
    vocab = logits.shape[1]
    width = int(k[small_k].max()) if bool(small_k.any()) else 0
    if not bool(small_k.all()):
        width = max(width, nucleus_width)
    width = min(width, vocab)
    values, ids = logits.topk(width, dim=-1)  # descending
    position = torch.arange(width, device=logits.device)
    values.masked_fill_(position[None, :] >= k[:, None], _NEG_INF)
    # Normalise over the top-k set where it fits, else over the whole vocabulary.
    log_total = values.logsumexp(dim=-1)
    wide = (~small_k).nonzero().squeeze(1)
    if wide.numel():
        log_total[wide] = logits.index_select(0, wide).logsumexp(dim=-1)
    probs = (values - log_total.unsqueeze(1)).exp()
    mass = probs.cumsum(dim=-1)
    keep = (mass - probs) < p[:, None]
    valid = small_k | (mass[:, -1] >= p)
    index = inverse_cdf(probs * keep, u)
    return ids.gather(1, index.unsqueeze(1)).squeeze(1), valid


def _sample_sorted(
    logits: torch.Tensor, u: torch.Tensor, k: torch.Tensor, p: torch.Tensor
) -> torch.Tensor:
    """Exact path: full sort, keep the k best, then the smallest set reaching p."""
    values, order = logits.sort(dim=-1, descending=True)
    return order.gather(1, inverse_cdf(kept_weights(values, k, p), u).unsqueeze(1)).squeeze(1)


def kept_weights(descending: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Probabilities of the kept tokens (0 elsewhere) of rows sorted descending."""
    position = torch.arange(descending.shape[1], device=descending.device)
    masked = descending.masked_fill(position[None, :] >= k[:, None], _NEG_INF)
    probs = masked.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    return probs * (before < p[:, None])
