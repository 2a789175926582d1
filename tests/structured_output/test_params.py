from __future__ import annotations

import json

import pytest

from tokenloom.structured_output import StructuredOutputsParams


def test_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match=r"^structured_outputs must set exactly one.*got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match=r"got regex, json_object"):
        StructuredOutputsParams(regex="a+", json_object=True)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"json": "{not json"}, "json"),
        ({"json": "[1, 2]"}, "json"),
        ({"json": 3}, "json"),
        ({"regex": ""}, "regex"),
        ({"choice": []}, "choice"),
        ({"choice": "ab"}, "choice"),
        ({"choice": ["a", ""]}, "choice"),
        ({"grammar": "  "}, "grammar"),
        ({"json_object": "yes"}, "json_object"),
        ({"regex": "a", "disable_any_whitespace": 1}, "disable_any_whitespace"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field} "):
        StructuredOutputsParams(**kwargs)  # type: ignore[arg-type]


def test_kind_and_cache_key() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    as_dict = StructuredOutputsParams(json=schema)
    as_text = StructuredOutputsParams(json=json.dumps(schema, indent=2))
    assert as_dict.kind == as_text.kind == "json"
    # The same schema, however written, is one compiled grammar.
    assert as_dict.cache_key() == as_text.cache_key()
    compact = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    assert compact.cache_key() != as_dict.cache_key()
    assert StructuredOutputsParams(choice=("x", "y")).choice == ["x", "y"]
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(grammar="root ::= 'a'").cache_key()[0] == "grammar"
    assert (
        StructuredOutputsParams(regex="a").cache_key()
        != StructuredOutputsParams(choice=["a"]).cache_key()
    )
