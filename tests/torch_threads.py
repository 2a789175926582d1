"""torch's intra-op thread count set for a block of a test, restored after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` inside, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
