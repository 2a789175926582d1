"""Structured outputs on the real default model, through the offline ``LLM``.

Every output must match its constraint, whatever the model would have said:
the grammar decides what is possible, the model only picks among it. The
schemas cover nested objects, arrays with bounds, enums, anyOf, numbers with
bounds, string patterns, required and optional fields and
additionalProperties false. Strings carry ``maxLength`` and JSON is compact
so that a 135M model at temperature 0.8 finishes within a modest max_tokens.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from tokenloom.outputs import RequestOutput
from tokenloom.sampling_params import SamplingParams
from tokenloom.structured_output import StructuredOutputsParams

pytestmark = pytest.mark.e2e

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }),
    ("a point", {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -10, "maximum": 10},
            "y": {"type": "number", "minimum": -10, "maximum": 10},
        },
        "required": ["x", "y"],
        "additionalProperties": False,
    }),
    ("a traffic light", {
        "type": "object",
        "properties": {"color": {"enum": ["red", "amber", "green"]}},
        "required": ["color"],
        "additionalProperties": False,
    }),
    ("a list of 2 to 3 fruits", {
        "type": "object",
        "properties": {"fruits": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 3}},
        "required": ["fruits"],
        "additionalProperties": False,
    }),
    ("an address", {
        "type": "object",
        "properties": {
            "street": NAME,
            "city": NAME,
            "geo": {
                "type": "object",
                "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                               "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
        },
        "required": ["street", "city", "geo"],
        "additionalProperties": False,
    }),
    ("a US zip code", {
        "type": "object",
        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["zip"],
        "additionalProperties": False,
    }),
    ("a product", {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "in_stock": {"type": "boolean"},
        },
        "required": ["sku", "price", "in_stock"],
        "additionalProperties": False,
    }),
    ("a user with an optional nickname", {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                       "nickname": NAME},
        "required": ["id"],
        "additionalProperties": False,
    }),
    ("a shape", {
        "type": "object",
        "properties": {
            "shape": {
                "anyOf": [
                    {"type": "object",
                     "properties": {"kind": {"const": "circle"},
                                    "radius": {"type": "integer", "minimum": 1, "maximum": 50}},
                     "required": ["kind", "radius"], "additionalProperties": False},
                    {"type": "object",
                     "properties": {"kind": {"const": "square"},
                                    "side": {"type": "integer", "minimum": 1, "maximum": 50}},
                     "required": ["kind", "side"], "additionalProperties": False},
                ]
            }
        },
        "required": ["shape"],
        "additionalProperties": False,
    }),
    ("an id that is a number or a code", {
        "type": "object",
        "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                        {"type": "string", "pattern": "^[a-z]{2,4}$"}]}},
        "required": ["id"],
        "additionalProperties": False,
    }),
    ("a weekly schedule", {
        "type": "object",
        "properties": {
            "days": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"day": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                                   "hours": {"type": "integer", "minimum": 0, "maximum": 12}},
                    "required": ["day", "hours"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["days"],
        "additionalProperties": False,
    }),
    ("an RGB color", {
        "type": "object",
        "properties": {c: {"type": "integer", "minimum": 0, "maximum": 255} for c in "rgb"},
        "required": ["r", "g", "b"],
        "additionalProperties": False,
    }),
    ("a book", {
        "type": "object",
        "properties": {
            "title": NAME,
            "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
            "isbn": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{10}$"},
        },
        "required": ["title", "year"],
        "additionalProperties": False,
    }),
    ("a yes/no answer with confidence", {
        "type": "object",
        "properties": {"answer": {"type": "boolean"},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["answer", "confidence"],
        "additionalProperties": False,
    }),
    ("a matrix of two rows of two small integers", {
        "type": "object",
        "properties": {"rows": {"type": "array", "minItems": 2, "maxItems": 2,
                                "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                          "items": {"type": "integer", "minimum": -9,
                                                    "maximum": 9}}}},
        "required": ["rows"],
        "additionalProperties": False,
    }),
    ("an event with a date", {
        "type": "object",
        "properties": {"name": NAME,
                       "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
        "required": ["name", "date"],
        "additionalProperties": False,
    }),
    ("a temperature reading", {
        "type": "object",
        "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60},
                       "unit": {"enum": ["C"]}},
        "required": ["celsius", "unit"],
        "additionalProperties": False,
    }),
    ("a team", {
        "type": "object",
        "properties": {
            "lead": {"type": "object",
                     "properties": {"name": NAME, "level": {"enum": ["junior", "senior"]}},
                     "required": ["name", "level"], "additionalProperties": False},
            "size": {"type": "integer", "minimum": 1, "maximum": 20},
        },
        "required": ["lead", "size"],
        "additionalProperties": False,
    }),
    ("a list of at most two tags", {
        "type": "object",
        "properties": {"tags": {"type": "array", "maxItems": 2,
                                "items": {"type": "string", "pattern": "^#[a-z]{1,8}$"}}},
        "required": ["tags"],
        "additionalProperties": False,
    }),
    ("a nullable middle name", {
        "type": "object",
        "properties": {"first": NAME, "middle": {"anyOf": [NAME, {"type": "null"}]}},
        "required": ["first", "middle"],
        "additionalProperties": False,
    }),
    ("a rating", {
        "type": "object",
        "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                       "verified": {"type": "boolean"}},
        "required": ["stars"],
        "additionalProperties": False,
    }),
    ("a version", {
        "type": "object",
        "properties": {"major": {"type": "integer", "minimum": 0, "maximum": 99},
                       "minor": {"type": "integer", "minimum": 0, "maximum": 99},
                       "label": {"enum": ["alpha", "beta", "stable"]}},
        "required": ["major", "minor", "label"],
        "additionalProperties": False,
    }),
]  # fmt: skip


def _ask(what: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Give me {what} as JSON."}]


def _only(output: RequestOutput) -> str:
    [completion] = output.outputs
    assert completion.finish_reason == "stop", (completion.finish_reason, completion.text)
    return completion.text


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_json_schemas_always_validate(llm: Any, temperature: float) -> None:
    assert len(SCHEMAS) >= 20
    params = [
        SamplingParams(
            temperature=temperature,
            seed=7,
            max_tokens=120,
            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        )
        for _, schema in SCHEMAS
    ]
    outputs = llm.chat([_ask(what) for what, _ in SCHEMAS], params, use_tqdm=False)
    for (_, schema), output in zip(SCHEMAS, outputs, strict=True):
        value = json.loads(_only(output))
        jsonschema.validate(value, schema)


def test_regex_choice_grammar_and_json_object(llm: Any) -> None:
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    choices = ["Positive", "Negative", "Neutral"]
    arithmetic = (
        'root ::= expr\nexpr ::= term (("+" | "-") term)*\n'
        'term ::= factor (("*" | "/") factor)*\nfactor ::= num | "(" expr ")"\n'
        "num ::= [1-9] [0-9]?"
    )
    cases = [
        ("What is a phone number?", StructuredOutputsParams(regex=phone)),
        ("Sentiment of 'I love it'?", StructuredOutputsParams(choice=choices)),
        ("Write an arithmetic expression.", StructuredOutputsParams(grammar=arithmetic)),
    ]
    for temperature in (0.0, 0.8):
        params = [
            SamplingParams(temperature=temperature, seed=3, max_tokens=60, structured_outputs=c)
            for _, c in cases
        ]
        messages = [[{"role": "user", "content": q}] for q, _ in cases]
        texts = [_only(o) for o in llm.chat(messages, params, use_tqdm=False)]
        assert re.fullmatch(phone, texts[0]), texts[0]
        assert texts[1] in choices
        assert _is_arithmetic(texts[2]), texts[2]


def test_json_object(llm: Any) -> None:
    # Any object: nothing bounds its size, so ask for a small one, greedily.
    params = SamplingParams(
        temperature=0.0,
        max_tokens=150,
        structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    )
    [output] = llm.chat(
        [
            {
                "role": "user",
                "content": 'Reply with {"answer": "yes"} or {"answer": "no"}: is ice cold?',
            }
        ],
        params,
        use_tqdm=False,
    )
    assert isinstance(json.loads(_only(output)), dict)


def _is_arithmetic(text: str) -> bool:
    """A small recursive-descent parser for the grammar above (digits, + - * /, parens)."""
    pos = 0

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            if not term():
                return False
        return True

    def term() -> bool:
        nonlocal pos
        if not factor():
            return False
        while pos < len(text) and text[pos] in "*/":
            pos += 1
            if not factor():
                return False
        return True

    def factor() -> bool:
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            if not expr() or pos >= len(text) or text[pos] != ")":
                return False
            pos += 1
            return True
        match = re.compile(r"[1-9][0-9]?").match(text, pos)
        if match is None:
            return False
        pos = match.end()
        return True

    return expr() and pos == len(text)


def test_free_requests_are_unchanged_by_structured_neighbours(llm: Any) -> None:
    prompts = [f"Tell me a fact about the number {i}." for i in range(32)]
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(prompts, free, use_tqdm=False)
    structured = SamplingParams(
        temperature=0.0,
        max_tokens=24,
        structured_outputs=StructuredOutputsParams(json=SCHEMAS[0][1], disable_any_whitespace=True),
    )
    mixed = llm.generate(
        [p for pair in zip(prompts, prompts, strict=True) for p in pair],
        [p for _ in prompts for p in (free, structured)],
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in mixed[0::2]] == [o.outputs[0].token_ids for o in alone]


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        (StructuredOutputsParams(json={"type": "object", "properties": 5}), "json"),
        (StructuredOutputsParams(regex="[unclosed"), "regex"),
        (StructuredOutputsParams(grammar="root ::= missing"), "grammar"),
    ],
)
def test_invalid_constraints_raise_naming_the_field(
    llm: Any, constraint: StructuredOutputsParams, field: str
) -> None:
    params = SamplingParams(max_tokens=4, structured_outputs=constraint)
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field} "):
        llm.generate("hello", params, use_tqdm=False)
    # The engine is untouched: the next request runs normally.
    [output] = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3


@pytest.fixture(scope="module")
def spec_llm(default_model_path: Any) -> Any:
    from tokenloom.engine.llm import LLM

    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    return LLM(
        str(default_model_path), num_blocks=128, max_model_len=512, speculative_config=config
    )


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_json_schemas_with_speculative_decoding(spec_llm: Any, temperature: float) -> None:
    """Drafts are cut at the grammar and masked at verification: outputs still validate."""
    schemas = SCHEMAS[:8]
    params = [
        SamplingParams(
            temperature=temperature,
            seed=11,
            max_tokens=120,
            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        )
        for _, schema in schemas
    ]
    outputs = spec_llm.chat([_ask(what) for what, _ in schemas], params, use_tqdm=False)
    for (_, schema), output in zip(schemas, outputs, strict=True):
        jsonschema.validate(json.loads(_only(output)), schema)
