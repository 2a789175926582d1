"""Applying the step's grammar bitmask to the logits, before sampling.

The engine fills one packed bitmask row per sampled position of each
structured request (``GrammarOutput``), in its own request order; the runner
knows where each request's rows sit among the logits. Rows of unstructured
requests are not touched.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from tokenloom.structured_output.manager import GrammarOutput


def apply_grammar_bitmask(
    logits: torch.Tensor,
    grammar: GrammarOutput,
    logits_rows: Mapping[str, tuple[int, int]],
) -> None:
    """Set disallowed tokens' logits to -inf, in place.

    ``logits_rows`` maps a request id to ``(first row, number of rows)`` of
    its sampled positions in ``logits`` ([R, V] float32). A structured request
    that samples nothing this step (a partial prefill) is skipped.
    """
    import xgrammar as xgr

    bitmask = grammar.grammar_bitmask
    targets: list[int] = []
    sources: list[int] = []
    src = 0
    for req_id, num_mask_rows in zip(
        grammar.structured_output_request_ids, grammar.rows_per_request, strict=True
    ):
        rows = logits_rows.get(req_id)
        if rows is not None:
            first, count = rows
            count = min(count, num_mask_rows)
            targets.extend(range(first, first + count))
            sources.extend(range(src, src + count))
        src += num_mask_rows
    if not targets:
        return
    num_rows, vocab = logits.shape
    if targets == sources and len(targets) == num_rows == bitmask.shape[0]:
        aligned = bitmask
    else:
        # xgrammar indexes logits and bitmask with the same row number.
        aligned = np.full((num_rows, bitmask.shape[1]), -1, dtype=np.int32)
        aligned[targets] = bitmask[sources]
    xgr.apply_token_bitmask_inplace(
        logits,
        torch.from_numpy(aligned),
        vocab_size=min(vocab, aligned.shape[1] * 32),
        indices=None if len(targets) == num_rows else targets,
    )
