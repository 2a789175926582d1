"""What a request's output must match: ``StructuredOutputsParams`` (vLLM's names).

Exactly one constraint is set: a JSON schema (``json``, a dict or a JSON
string), a regular expression (``regex``), a list of literal choices
(``choice``), an EBNF grammar (``grammar``, xgrammar's GBNF dialect), or any
JSON object (``json_object=True``). This module only checks the shape of the
parameters (cheap, no backend import); whether a schema, regex or grammar is
valid is decided by the backend when the request is processed.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

from tokenloom.structured_output.reasoning_gate import ReasoningGate

# The constraint fields, in the order messages list them.
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Constrain generated text; exactly one of the constraint fields may be set.

    ``disable_any_whitespace`` makes JSON compact (no free whitespace between
    tokens), which keeps small models from wandering into long runs of spaces.
    ``reasoning_gate`` (set by the front end for reasoning models): the
    constraint applies only after the thinking (see ``reasoning_gate.py``).
    Invalid values raise ``ValueError`` whose message starts with the field
    name (``structured_outputs.regex ...``).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    reasoning_gate: ReasoningGate | None = None

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, str):
            self.choice = list(self.choice)
        self._validate()

    def _validate(self) -> None:
        def fail(field: str, message: str) -> None:
            raise ValueError(f"structured_outputs.{field} {message}")

        set_fields = [name for name in CONSTRAINT_FIELDS if self._is_set(name)]
        if len(set_fields) != 1:
            given = ", ".join(set_fields) if set_fields else "none"
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(CONSTRAINT_FIELDS)} (got {given})"
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = _json.loads(self.json)
                except ValueError as exc:
                    fail("json", f"is not valid JSON: {exc}")
                if not isinstance(schema, (dict, bool)):
                    fail("json", "must be a JSON schema object")
            elif not isinstance(self.json, dict):
                fail("json", f"must be a dict or a JSON string, got {type(self.json).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            fail("regex", "must be a non-empty string")
        if self.choice is not None and (
            isinstance(self.choice, str)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            fail("choice", "must be a non-empty list of non-empty strings")
        if self.grammar is not None and (
            not isinstance(self.grammar, str) or not self.grammar.strip()
        ):
            fail("grammar", "must be a non-empty string")
        if not isinstance(self.json_object, bool):
            fail("json_object", "must be a boolean")
        if not isinstance(self.disable_any_whitespace, bool):
            fail("disable_any_whitespace", "must be a boolean")
        if self.reasoning_gate is not None and not isinstance(self.reasoning_gate, ReasoningGate):
            fail("reasoning_gate", "must be a ReasoningGate")

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        return value is not False and value is not None

    @property
    def kind(self) -> str:
        """The constraint's field name: ``json``, ``regex``, ``choice``, ``grammar``,
        or ``json_object``."""
        return next(name for name in CONSTRAINT_FIELDS if self._is_set(name))

    def schema_text(self) -> str:
        """The JSON schema as canonical text (sorted keys); only for ``json``."""
        if isinstance(self.json, str):
            return _json.dumps(_json.loads(self.json), sort_keys=True)
        return _json.dumps(self.json, sort_keys=True)

    def cache_key(self) -> tuple[str, str, bool]:
        """Identifies the compiled grammar: equal keys, one compilation."""
        kind = self.kind
        spec: str
        if kind == "json":
            spec = self.schema_text()
        elif kind == "choice":
            spec = _json.dumps(self.choice)
        elif kind == "json_object":
            spec = ""
        else:
            spec = getattr(self, kind)
        return kind, spec, self.disable_any_whitespace
