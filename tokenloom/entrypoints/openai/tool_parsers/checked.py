"""Tool calls a client can trust: only finished calls that hold up, the same whole or streamed.

``settle(parser, checker, text, final)`` turns a parser's segments into the
reply's content and calls. A call is returned only when it is finished and
``ToolCallChecker`` accepts it: a function of the request, arguments that
parse as a JSON object (no NaN or Infinity) and validate against the
function's ``parameters`` schema. A call cut off by ``max_tokens`` is not
finished, so it is never returned. Without ``parallel_tool_calls`` only the
first good call is. The text of a call that fails goes back into the
content, for parsers of free text (``ToolParser.failed_calls_are_content``).

Streaming re-settles the whole text after each delta (``chat_reply.py``)
and sends what is new: content as it becomes certain, each call whole once
it is accepted. Every view of a prefix is a prefix of the final one (the
parsers hold back what may change), so the deltas add up to exactly the
non-streamed reply.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenloom.entrypoints.openai.tool_parsers.base import ParsedToolCall, ToolParser

# The schema of a function declared without parameters: any arguments object.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class CheckedCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


@dataclass
class SettledOutput:
    """``content``: the text outside returned calls, stripped ("" when none)."""

    content: str
    calls: list[CheckedCall] = field(default_factory=list)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class ToolCallChecker:
    """Checks calls against a request's functions (``name -> parameters schema``).

    Raises ``ValueError`` naming the function whose schema is not a valid
    JSON schema (the request is refused before it runs).
    """

    def __init__(self, functions: Mapping[str, dict[str, Any] | None], parallel: bool) -> None:
        from jsonschema import SchemaError, validators

        self.parallel = parallel
        self._validators: dict[str, Any] = {}
        for name, schema in functions.items():
            schema = _ANY_OBJECT if schema is None else schema
            cls = validators.validator_for(schema)
            try:
                cls.check_schema(schema)
            except SchemaError as exc:
                raise ValueError(
                    f"tools: the parameters of {name!r} are not a valid JSON schema: {exc.message}"
                ) from None
            self._validators[name] = cls(schema)

    def check(self, call: ParsedToolCall) -> CheckedCall | None:
        """The call as returned to the client, or None when it cannot be trusted."""
        if not call.complete or call.name is None:
            return None
        validator = self._validators.get(call.name)
        if validator is None:
            return None
        try:
            arguments = json.loads(call.arguments, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            return None
        if not isinstance(arguments, dict):
            return None
        try:
            if not validator.is_valid(arguments):
                return None
        except Exception:  # an unresolvable $ref and the like: not trusted
            return None
        return CheckedCall(call.name, json.dumps(arguments, ensure_ascii=False))


def settle(parser: ToolParser, checker: ToolCallChecker, text: str, final: bool) -> SettledOutput:
    """The reply in ``text`` (the output so far, all of it if ``final``)."""
    parts: list[str] = []
    calls: list[CheckedCall] = []
    for segment in parser.segments(text, final):
        if isinstance(segment, str):
            parts.append(segment)
            continue
        if not segment.complete and not final:
            break  # unfinished, and the last segment: nothing after it is known
        checked = checker.check(segment)
        if checked is not None:
            if checker.parallel or not calls:
                calls.append(checked)
        elif parser.failed_calls_are_content:
            parts.append(segment.raw)
    return SettledOutput("".join(parts).strip(), calls)
