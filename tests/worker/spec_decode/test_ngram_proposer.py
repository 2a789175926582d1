import numpy as np
import pytest

from tokenloom.worker.spec_decode.ngram_proposer import NgramProposer


def _batch(rows: list[list[int]], width: int = 64) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    return tokens, np.array([len(r) for r in rows])


def _reference(row: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, one token at a time: longest n, latest earlier occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if len(row) <= n:
            continue
        suffix = row[-n:]
        for j in range(len(row) - n - 1, -1, -1):
            if row[j : j + n] == suffix:
                return row[j + n : j + n + k]
    return []


def test_proposes_what_followed_the_latest_longest_match() -> None:
    proposer = NgramProposer(min_n=1, max_n=3, num_speculative_tokens=3)
    rows = [
        [1, 2, 3, 4, 5, 9, 1, 2, 3],  # 3-gram [1,2,3] seen at 0 -> [4, 5, 9]
        [7, 8, 7, 9, 7],  # 1-gram [7]: latest earlier at 2 -> [9, 7]
        [5, 6, 7],  # no repeat
        [1, 1, 1, 1],  # self-overlapping run
    ]
    tokens, lengths = _batch(rows)
    assert proposer.propose(tokens, lengths) == [[4, 5, 9], [9, 7], [], [1]]


def test_caps_and_skips() -> None:
    proposer = NgramProposer(min_n=1, max_n=2, num_speculative_tokens=4)
    tokens, lengths = _batch([[3, 4, 5, 6, 3, 4], [3, 4, 5, 6, 3, 4]])
    assert proposer.propose(tokens, lengths, np.array([2, 0])) == [[5, 6], []]


@pytest.mark.parametrize("seed", range(5))
def test_matches_the_reference_on_random_rows(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, 6, size=int(rng.integers(1, 60))).tolist() for _ in range(32)]
    tokens, lengths = _batch(rows)
    proposer = NgramProposer(min_n=2, max_n=4, num_speculative_tokens=5)
    expected = [_reference(r, 2, 4, 5) for r in rows]
    assert proposer.propose(tokens, lengths) == expected


def test_invalid_settings_name_the_key() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2, 4)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(1, 2, 0)
