from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from tokenloom.structured_output import StructuredOutputsParams
from tokenloom.structured_output.backend_xgrammar import (
    XgrammarBackend,
    bitmask_words,
    choice_grammar,
    validate,
)

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def backend(tokenizer: Any) -> XgrammarBackend:
    return XgrammarBackend(tokenizer, VOCAB, [EOS])


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (StructuredOutputsParams(regex="(abc"), "regex"),
        (StructuredOutputsParams(regex="a{3,1}"), "regex"),
        (StructuredOutputsParams(json={"type": "no-such-type"}), "json"),
        (StructuredOutputsParams(json={"type": "object", "required": 3}), "json"),
        (StructuredOutputsParams(grammar="root ::= undefined_rule"), "grammar"),
        (StructuredOutputsParams(grammar="this is not ebnf"), "grammar"),
    ],
)
def test_validate_rejects_with_the_field(params: StructuredOutputsParams, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field} ") as info:
        validate(params)
    # The backend's location prefix is stripped; the reason stays.
    assert ".cc:" not in str(info.value)


def test_validate_accepts_every_kind() -> None:
    for params in (
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
        StructuredOutputsParams(regex=r"\d{3}-\d{4}"),
        StructuredOutputsParams(choice=["yes", "no"]),
        StructuredOutputsParams(grammar='root ::= "a" root | "b"'),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    ):
        validate(params)
        validate(params)  # the second time from the cache of valid constraints


def _allowed(bitmask: np.ndarray, row: int) -> set[int]:
    bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:VOCAB]).tolist())


def _walk(backend: XgrammarBackend, tokenizer: Any, params: StructuredOutputsParams, text: str):
    matcher = backend.new_matcher(backend.compile(params))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher, ids


def test_matcher_accepts_a_matching_text_then_terminates_on_eos(
    backend: XgrammarBackend, tokenizer: Any
) -> None:
    params = StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}")
    matcher, ids = _walk(backend, tokenizer, params, "555-1234")
    assert matcher.accept_tokens(ids)
    assert matcher.num_processed_tokens == len(ids)
    bitmask = np.zeros((1, bitmask_words(VOCAB)), dtype=np.int32)
    matcher.fill_bitmask(bitmask, 0)
    assert _allowed(bitmask, 0) == {EOS}
    assert not matcher.is_terminated()
    assert matcher.accept_tokens([EOS])
    assert matcher.is_terminated()


def test_matcher_refuses_and_validates_without_moving(
    backend: XgrammarBackend, tokenizer: Any
) -> None:
    params = StructuredOutputsParams(choice=["apple pie", "banana split"])
    matcher, ids = _walk(backend, tokenizer, params, "banana split")
    wrong = tokenizer.encode("cherry", add_special_tokens=False)
    assert matcher.validate_tokens(ids + wrong) == ids
    assert matcher.num_processed_tokens == 0
    assert not matcher.accept_tokens(wrong[:1])
    assert matcher.accept_tokens(ids)
    matcher.rollback(len(ids))
    assert matcher.num_processed_tokens == 0
    assert matcher.accept_tokens(tokenizer.encode("apple pie", add_special_tokens=False))


def test_initial_bitmask_of_a_json_schema(backend: XgrammarBackend, tokenizer: Any) -> None:
    params = StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        disable_any_whitespace=True,
    )
    matcher = backend.new_matcher(backend.compile(params))
    bitmask = np.zeros((1, bitmask_words(VOCAB)), dtype=np.int32)
    matcher.fill_bitmask(bitmask, 0)
    allowed = _allowed(bitmask, 0)
    assert allowed and EOS not in allowed
    for token in allowed:
        assert tokenizer.decode([token]).startswith("{")


def test_choice_grammar_escapes_literals() -> None:
    choices = ['say "hi"', "back\\slash", "new\nline", "tab\there", "plain"]
    grammar = choice_grammar(choices)
    validate(StructuredOutputsParams(grammar=grammar))
    assert grammar.startswith("root ::= ")
    assert re.search(r'"say \\"hi\\""', grammar)
