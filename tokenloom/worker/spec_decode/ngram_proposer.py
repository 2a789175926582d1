"""Prompt-lookup (n-gram) drafting: propose what followed the request's own
latest n-gram the last time it occurred in its tokens (prompt and output).

For every request of the batch at once: for n from ``max_n`` down to ``min_n``,
compare each earlier window of n tokens with the last n tokens (n vectorised
comparisons of the whole ``[B, L]`` token matrix), keep the latest earlier
match, and propose up to ``k`` tokens that followed it. Longer matches win;
requests already matched at a longer n are not searched again.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Drafts for a batch of token rows; no model, no state between steps."""

    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}"
            )
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.min_n = min_n
        self.max_n = max_n
        self.k = num_speculative_tokens

    def propose(
        self, token_ids: np.ndarray, num_tokens: np.ndarray, max_drafts: np.ndarray | None = None
    ) -> list[list[int]]:
        """Drafts per row of ``token_ids`` ``[B, W]`` holding ``num_tokens[b]`` tokens each.

        ``max_drafts[b]`` caps row ``b``'s drafts (0 skips it; default ``k``).
        """
        num_rows = token_ids.shape[0]
        lengths = num_tokens.astype(np.int64)
        caps = (
            np.full(num_rows, self.k, np.int64)
            if max_drafts is None
            else np.minimum(max_drafts, self.k)
        )
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        todo = np.flatnonzero((caps > 0) & (lengths > self.min_n))
        if todo.size == 0:
            return drafts
        width = int(lengths[todo].max())
        tokens = token_ids[todo, :width]
        lens = lengths[todo]
        rows = np.arange(todo.size)
        found = np.full(todo.size, -1, np.int64)  # continuation start of the match
        for n in range(self.max_n, self.min_n - 1, -1):
            open_rows = (found < 0) & (lens > n)
            if not open_rows.any():
                continue
            span = width - n  # candidate window starts 0 .. span - 1
            match = np.ones((todo.size, span), dtype=bool)
            for i in range(n):
                suffix_i = tokens[rows, np.maximum(lens - n + i, 0)]
                match &= tokens[:, i : i + span] == suffix_i[:, None]
            # A match must end before the suffix itself starts being compared with
            # itself: window start j < len - n (so a continuation token exists).
            match &= np.arange(span)[None, :] < (lens - n)[:, None]
            match &= open_rows[:, None]
            has = match.any(axis=1)
            last = span - 1 - np.argmax(match[:, ::-1], axis=1)
            found = np.where(has & (found < 0), last + n, found)
        for j in np.flatnonzero(found >= 0).tolist():
            start = int(found[j])
            stop = min(start + int(caps[todo[j]]), int(lens[j]))
            drafts[int(todo[j])] = tokens[j, start:stop].tolist()
        return drafts
