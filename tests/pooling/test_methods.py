"""The pooling math: per-request sums of a ragged batch, Matryoshka truncation and
normalisation, as little-endian float32 bytes."""

from __future__ import annotations

import torch

from tokenloom.outputs import float32_values
from tokenloom.pooling.methods import finish_vectors, segment_sums


def test_segment_sums_add_up_each_requests_rows() -> None:
    hidden = torch.arange(12, dtype=torch.bfloat16).reshape(6, 2)
    sums = segment_sums(hidden, torch.tensor([1, 3, 2]))
    assert sums.dtype == torch.float32
    assert sums.tolist() == [[0.0, 1.0], [2 + 4 + 6, 3 + 5 + 7], [8 + 10, 9 + 11]]


def test_finish_vectors_cut_then_normalise_each_row_as_asked() -> None:
    vectors = torch.tensor([[3.0, 4.0, 12.0], [3.0, 4.0, 12.0], [0.0, 0.0, 0.0]])
    rows = finish_vectors(vectors, [None, 2, None], [True, True, False])
    values = [float32_values(r) for r in rows]
    assert values[0] == torch.tensor([3 / 13, 4 / 13, 12 / 13]).tolist()
    assert values[1] == torch.tensor([3 / 5, 4 / 5]).tolist()  # the first 2, renormalised
    assert values[2] == [0.0, 0.0, 0.0]  # not normalised, and zero stays zero
    batched = finish_vectors(vectors[:2], [None, None], [True, True])
    assert [float32_values(r) for r in batched] == [values[0], values[0]]
    assert all(len(r) == 4 * n for r, n in zip(rows, (3, 2, 3), strict=True))
