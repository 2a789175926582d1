"""``tokenloom.options``: one declaration gives the check, its message and the flag."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from tokenloom.options import OptionError, add_cli_args, build, option, validate


@dataclass(frozen=True)
class Example:
    """An example config.

    Not in the flag group's description."""

    count: int = option(4, ge=1, help="how many")
    ratio: float = option(0.5, gt=0, le=1, arg="example_ratio", help="a share")
    mode: Literal["fast", "slow"] = option("fast", help="which way")
    name: str | None = option(None, pattern=r"[a-z]+", requirement="lower-case letters", help="x")
    tags: list[str] | None = option(None, help="labels")
    on: bool = option(True, help="switch", aliases=("-o",))
    spec: dict[str, Any] | None = option(None, parse=json.loads, metavar="JSON", help="JSON")
    internal: float = 9.0  # not an option: no flag, no check
    nested: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        validate(self)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"count": 0}, "count must be an integer >= 1, got 0"),
        ({"count": True}, "count must be an integer >= 1, got True"),
        ({"count": 2.0}, "count must be an integer >= 1, got 2.0"),
        ({"ratio": 0}, "ratio must be a number in (0, 1], got 0"),
        ({"ratio": "0.5"}, "ratio must be a number in (0, 1], got '0.5'"),
        ({"mode": "medium"}, "mode must be one of {fast, slow}, got 'medium'"),
        ({"name": "Abc"}, "name must be lower-case letters or None, got 'Abc'"),
        ({"tags": ["a", 1]}, "tags must be a list of strings or None, got ['a', 1]"),
        ({"on": 1}, "on must be a bool, got 1"),
        ({"spec": "{}"}, "spec must be a dict or None, got '{}'"),
    ],
)
def test_checks_name_the_field_and_what_it_allows(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(OptionError) as info:
        Example(**kwargs)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


def test_valid_values_and_internal_fields_pass() -> None:
    example = Example(count=1, ratio=1, mode="slow", name="abc", tags=["a"], on=False, internal=-1)
    assert example.ratio == 1 and example.internal == -1


def test_flags_are_derived_from_the_declarations() -> None:
    parser = argparse.ArgumentParser()
    add_cli_args(parser, Example)
    assert vars(parser.parse_args([])) == {
        "count": 4,
        "example_ratio": 0.5,
        "mode": "fast",
        "name": None,
        "tags": None,
        "on": True,
        "spec": None,
    }
    args = parser.parse_args(
        ["--count", "7", "--example-ratio", "0.25", "--mode", "slow", "--tags", "a", "b"]
        + ["--no-on", "--spec", '{"k": 1}']
    )
    assert (args.count, args.example_ratio, args.mode, args.tags, args.on) == (
        7,
        0.25,
        "slow",
        ["a", "b"],
        False,
    )
    assert parser.parse_args(["-o"]).on is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "medium"])  # choices come from the Literal
    group = parser._action_groups[-1]
    assert (group.title, group.description) == ("Example", "An example config.")
    # --spec stays text on the command line; build parses it.
    built = build(Example, vars(args))
    assert built.spec == {"k": 1} and built.count == 7 and built.ratio == 0.25


def test_build_names_the_argument_and_takes_fixed_fields() -> None:
    with pytest.raises(ValueError, match=r"^example_ratio must be a number in \(0, 1\]"):
        build(Example, {"example_ratio": 2.0})
    with pytest.raises(ValueError, match=r"^count must be"):
        build(Example, {"count": 0})
    built = build(Example, {"count": 2, "unrelated": 1}, internal=3.0)
    assert (built.count, built.internal, built.mode) == (2, 3.0, "fast")


def test_add_cli_args_can_skip_an_option() -> None:
    parser = argparse.ArgumentParser()
    add_cli_args(parser, Example, title="example", skip=("count",))
    assert "count" not in vars(parser.parse_args([]))


def test_a_default_that_breaks_its_own_declaration_is_a_programming_error() -> None:
    @dataclass(frozen=True)
    class Broken:
        size: int = option(0, ge=1, help="size")

        def __post_init__(self) -> None:
            validate(self)

    with pytest.raises(TypeError, match="default 0 is not an integer >= 1"):
        Broken()
