from __future__ import annotations

import numpy as np
import torch

from tokenloom.structured_output.manager import GrammarOutput
from tokenloom.worker.grammar_bitmask import apply_grammar_bitmask

VOCAB = 100
WORDS = (VOCAB + 31) // 32


def _mask(*allowed: int) -> np.ndarray:
    bits = np.zeros(WORDS * 32, dtype=np.uint8)
    bits[list(allowed)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def test_rows_land_on_their_requests_and_others_are_untouched() -> None:
    logits = torch.randn(5, VOCAB)
    before = logits.clone()
    # Engine order b, a; b verifies one draft (2 rows). The runner's rows:
    # free request at 0, a at 1, b at 2-3, another free one at 4.
    grammar = GrammarOutput(["b", "a"], np.stack([_mask(7), _mask(8, 9), _mask(3)]), [2, 1])
    apply_grammar_bitmask(logits, grammar, {"a": (1, 1), "b": (2, 2), "free": (0, 1)})
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[4], before[4])
    for row, allowed in ((1, {3}), (2, {7}), (3, {8, 9})):
        finite = set(torch.isfinite(logits[row]).nonzero().flatten().tolist())
        assert finite == allowed
        for token in allowed:
            assert logits[row, token] == before[row, token]


def test_a_request_that_samples_nothing_is_skipped() -> None:
    logits = torch.randn(1, VOCAB)
    grammar = GrammarOutput(["prefilling", "a"], np.stack([_mask(1), _mask(2)]), [1, 1])
    apply_grammar_bitmask(logits, grammar, {"a": (0, 1)})
    assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) == {2}


def test_all_rows_structured_in_order() -> None:
    logits = torch.zeros(2, VOCAB)
    grammar = GrammarOutput(["a", "b"], np.stack([_mask(0), _mask(99)]), [1, 1])
    apply_grammar_bitmask(logits, grammar, {"a": (0, 1), "b": (1, 1)})
    assert logits.argmax(dim=-1).tolist() == [0, 99]
