"""The distribution the sampler draws each row from, as a dense probability matrix.

Rejection sampling compares probabilities, so it needs what the sampler only
ever walks implicitly: ``softmax(logits / temperature)`` after min-p, top-k
and top-p, renormalised over the kept tokens. The steps and their order are
the sampler's (``worker/sampler.py``), built from the same functions
(``apply_min_p``, ``kept_weights``), so a token the sampler could never draw
has probability exactly 0 here and the kept ones are in the same proportions.
Banned tokens and penalties are applied to the logits before this (as the
sampler does first). Greedy rows (temperature 0) come out at temperature 1:
only their argmax is used.
"""

from __future__ import annotations

import torch

from tokenloom.worker.sampler import apply_min_p
from tokenloom.worker.sampling_metadata import SamplingMetadata
from tokenloom.worker.top_k_top_p import kept_weights, row_limits


def processed_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """[R, V] float32 rows summing to 1, one per row of ``metadata``."""
    return shaped_probs(
        logits, metadata.temperature, metadata.top_k, metadata.top_p, metadata.min_p
    )


def shaped_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """``processed_probs`` from per-row tensors (top_k >= vocab, top_p 1, min_p 0: off).
    ``logits`` is not modified."""
    temperature = torch.where(temperature == 0.0, 1.0, temperature)
    scaled = logits / temperature.unsqueeze(1).to(logits.dtype)
    if min_p is not None:
        scaled = apply_min_p(scaled, min_p)
    if top_k is None and top_p is None:
        return scaled.softmax(dim=-1)
    k, p = row_limits(scaled, top_k, top_p)
    values, order = scaled.sort(dim=-1, descending=True)
    kept = kept_weights(values, k, p)
    kept = kept / kept.sum(dim=-1, keepdim=True)
    return torch.zeros_like(kept).scatter_(1, order, kept)
