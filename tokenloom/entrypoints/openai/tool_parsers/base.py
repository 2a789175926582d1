"""What every tool-call parser provides: the output as text and calls, in order.

A parser is written once, as ``segments(text, final)``: the output cut into
content text and tool calls as the model wrote them. With ``final=False``
the text is a prefix of the output, and every segment but the last is
final: the last may be text still growing (with a possible start of a call
held back) or a call not finished yet. Whether a call can be trusted (its
JSON, its function, its schema) is decided elsewhere (``checked.py``), once
the call is finished, so whole and streamed responses carry the same calls.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from tokenloom.reasoning.parser import held_back_end


@dataclass
class ParsedToolCall:
    """One call as written.

    ``name`` is None until known (or when the call is not a call at all);
    ``arguments`` is the JSON text of its arguments; ``complete`` once the
    call is finished (closed). ``raw`` is its text as the model wrote it.
    """

    name: str | None
    arguments: str = ""
    complete: bool = False
    raw: str = ""


Segment = str | ParsedToolCall


class ToolParser(ABC):
    """Finds tool calls in generated text; stateless, so one instance serves every request."""

    # The text of a call that cannot be trusted (bad JSON, unknown function, a
    # schema violation, cut off) goes back into the content: the model wrote it.
    # Parsers of grammar-forced output (whose text is never a message) say no.
    failed_calls_are_content: ClassVar[bool] = True

    @abstractmethod
    def segments(self, text: str, final: bool) -> list[Segment]:
        """``text`` (the output so far, all of it if ``final``) as content and calls."""


def text_segment(text: str, final: bool, *markers: str) -> list[Segment]:
    """``text`` as one content segment, less a possible start of a marker at its end."""
    if not final:
        text = text[: min((held_back_end(text, m) for m in markers), default=len(text))]
    return [text] if text else []


# ---------------------------------------------------------------- JSON scanning

_SCALAR = re.compile(r"-?[0-9.eE+\-]+|true|false|null")


def scan_json_value(text: str, start: int) -> tuple[int, bool]:
    """Scan the JSON object, array or string starting at ``text[start]``.

    Returns ``(end, complete)``: when complete, ``text[start:end]`` is the
    whole value; otherwise ``end`` is how far the text surely belongs to the
    value (everything, since an unfinished object or array has not closed).
    Scalars (numbers, true, ...) are complete only once something follows
    them; until then ``end == start``.
    """
    n = len(text)
    if start >= n:
        return start, False
    if text[start] not in '{["':
        match = _SCALAR.match(text, start)
        if match is None or match.end() == n:
            return start, False
        return match.end(), True
    end = balanced_end(text, start, '"')
    return (n, False) if end is None else (end, True)


_CLOSERS = {"(": ")", "[": "]", "{": "}"}


def balanced_end(text: str, start: int, quotes: str) -> int | None:
    """The index after the bracketed group or string opening at ``text[start]``
    (None while it is open).

    Strings open and close with any of ``quotes`` and take backslash escapes.
    A closing bracket that does not match ends the group there: what it
    holds will not parse, and no more text can change that.
    """
    stack: list[str] = []
    quote = ""
    escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
                if not stack:
                    return i + 1
        elif ch in quotes:
            quote = ch
        elif ch in _CLOSERS:
            stack.append(_CLOSERS[ch])
        elif ch in ")]}":
            if not stack or stack.pop() != ch or not stack:
                return i + 1
    return None


def json_call(block: str, args_keys: tuple[str, ...], raw: str) -> ParsedToolCall:
    """A finished call written as one JSON object, ``{"name": ..., <args key>: {...}}``,
    whose text as written is ``raw``.

    Keys may come in any order; the first of ``args_keys`` present holds the
    arguments (none: no arguments). Anything else is a call without a name,
    which no check accepts.
    """
    failed = ParsedToolCall(None, complete=True, raw=raw)
    try:
        obj = json.loads(block)
    except ValueError:
        return failed
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return failed
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False), True, raw)
