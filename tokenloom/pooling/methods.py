"""The pooling math over final hidden states (after the model's final norm).

A step's hidden states are one flat ragged batch, request after request
(``query_lens`` rows each). ``segment_sums`` adds up each request's rows (mean
pooling accumulates them over a prompt's chunks); ``finish_vectors`` turns
pooled vectors into what a request asked for: the first ``dimensions``
values (Matryoshka truncation), then L2-normalised, as little-endian float32
bytes. Everything is computed in float32, whatever the model's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# Below this norm a vector is left as it is rather than blown up (torch's F.normalize eps).
_NORM_EPS = 1e-12


def segment_sums(hidden: torch.Tensor, query_lens: torch.Tensor) -> torch.Tensor:
    """[B, H] float32: the sum of each request's rows of ``hidden`` [T, H], where
    request ``i`` owns the next ``query_lens[i]`` rows."""
    segment = torch.repeat_interleave(
        torch.arange(len(query_lens), device=hidden.device), query_lens.to(hidden.device)
    )
    sums = torch.zeros(len(query_lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    return sums.index_add_(0, segment, hidden.float())


def finish_vectors(
    vectors: torch.Tensor, dimensions: Sequence[int | None], normalize: Sequence[bool]
) -> list[bytes]:
    """Each row of ``vectors`` [N, H], cut to its ``dimensions`` and normalised where
    asked, as little-endian float32 bytes."""
    vectors = vectors.detach().float()
    if all(d is None for d in dimensions) and all(normalize):  # the common case, batched
        vectors = torch.nn.functional.normalize(vectors, p=2.0, dim=-1, eps=_NORM_EPS)
        return [row.tobytes() for row in _little_endian(vectors)]
    rows: list[bytes] = []
    for row, dims, norm in zip(vectors, dimensions, normalize, strict=True):
        if dims is not None:
            row = row[:dims]
        if norm:
            row = row / row.norm(p=2).clamp_min(_NORM_EPS)
        rows.append(_little_endian(row).tobytes())
    return rows


def _little_endian(values: torch.Tensor) -> np.ndarray:
    return values.cpu().numpy().astype("<f4", copy=False)
