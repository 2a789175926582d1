from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest

from tokenloom.structured_output import StructuredOutputsParams
from tokenloom.structured_output.manager import StructuredOutputManager, StructuredOutputRequest

VOCAB = 49152
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture
def manager(tokenizer: Any):
    manager = StructuredOutputManager(lambda: tokenizer, VOCAB, [EOS], max_cache_entries=4)
    yield manager
    manager.shutdown()


def _ready(request: StructuredOutputRequest, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not request.is_ready():
        assert time.monotonic() < deadline, "grammar did not compile"
        time.sleep(0.005)


def _allowed(bitmask: np.ndarray, row: int) -> set[int]:
    bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:VOCAB]).tolist())


def test_a_repeated_schema_compiles_once(manager: StructuredOutputManager) -> None:
    requests = [manager.grammar_init(StructuredOutputsParams(json=SCHEMA)) for _ in range(8)]
    # Written differently, the same schema is the same grammar.
    as_text = json.dumps(SCHEMA, indent=1)
    requests.append(manager.grammar_init(StructuredOutputsParams(json=as_text)))
    for request in requests:
        _ready(request)
        assert request.error is None
    stats = manager.make_stats()
    assert (stats.num_requests, stats.num_compiles, stats.num_cache_hits) == (9, 1, 8)
    assert len(stats.compile_times) == 1 and stats.compile_times[0] > 0
    # Each request walks its own matcher.
    first, second = requests[0].grammar, requests[1].grammar
    assert first is not None and second is not None and first is not second
    assert manager.make_stats().num_requests == 0  # deltas


def test_a_failed_compile_is_reported_and_not_cached(manager: StructuredOutputManager) -> None:
    bad = StructuredOutputsParams(regex="(unclosed")
    request = manager.grammar_init(bad)
    _ready(request)
    assert request.grammar is None
    assert request.error is not None and request.error.startswith("structured_outputs.regex ")
    assert manager.num_cached_grammars == 0
    good = manager.grammar_init(StructuredOutputsParams(regex="[ab]+"))
    _ready(good)
    assert good.grammar is not None and manager.num_cached_grammars == 1


def test_cache_keeps_the_most_recent_constraints(manager: StructuredOutputManager) -> None:
    for i in range(6):
        _ready(manager.grammar_init(StructuredOutputsParams(regex=f"x{i}")))
    assert manager.num_cached_grammars == 4
    _ready(manager.grammar_init(StructuredOutputsParams(regex="x5")))
    assert manager.make_stats().num_cache_hits == 1


def test_bitmask_rows_follow_the_drafts(manager: StructuredOutputManager, tokenizer: Any) -> None:
    text = "hello world, hello tokens"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) >= 4
    plain = manager.grammar_init(StructuredOutputsParams(choice=[text]))
    drafted = manager.grammar_init(StructuredOutputsParams(choice=[text]))
    refused = manager.grammar_init(StructuredOutputsParams(choice=[text]))
    for request in (plain, drafted, refused):
        _ready(request)
    matchers = [(r, req.grammar) for r, req in (("p", plain), ("d", drafted), ("x", refused))]
    assert all(m is not None for _, m in matchers)
    bad_draft = EOS  # not allowed before the end
    out = manager.grammar_bitmask(
        [(r, m) for r, m in matchers if m is not None],
        {"d": ids[:3], "x": [ids[0], ids[1], bad_draft]},
    )
    assert out.structured_output_request_ids == ["p", "d", "x"]
    assert out.rows_per_request == [1, 4, 4]
    mask = out.grammar_bitmask
    assert mask.shape == (9, (VOCAB + 31) // 32)
    # Other tokenizations of the text are allowed too, so check membership.
    assert ids[0] in _allowed(mask, 0) and EOS not in _allowed(mask, 0)
    for i in range(4):  # row i of the drafted request: what may follow drafts[:i]
        assert ids[i] in _allowed(mask, 1 + i)
        assert _allowed(mask, 1 + i) != _allowed(mask, i) or i == 0
    assert [ids[i] in _allowed(mask, 5 + i) for i in range(3)] == [True] * 3
    assert EOS not in _allowed(mask, 7)
    assert (mask[8] == -1).all()  # after the refused draft: anything (it is rejected anyway)
    # Filling never moves a matcher.
    for _, matcher in matchers:
        assert matcher is not None and matcher.num_processed_tokens == 0
