"""JSON request bodies to pydantic models, with every failure a 400 naming the field.

Python's ``json`` accepts things that later break the server: nesting deep
enough to raise ``RecursionError`` (here or in whatever walks the data next,
a chat template for instance) and lone UTF-16 surrogates (``"\\ud800"``),
which cannot be encoded back to UTF-8 when a response echoes them. Both are
refused here, before the request reaches a handler.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from .errors import OpenAIError, from_validation_error

M = TypeVar("M", bound=BaseModel)

# Deeper than any request we take needs (tool schemas included).
MAX_JSON_DEPTH = 64

# A surrogate can only enter a body as a \\u escape: as raw UTF-8 it is invalid.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def decode_body(body: bytes, model: type[M]) -> M:
    """Parse ``body`` as a JSON object and validate it as ``model``."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise OpenAIError(f"request body is nested more than {MAX_JSON_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OpenAIError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise OpenAIError("request body must be a JSON object")
    # Both scans are C-speed; the tree walk runs only when one of them finds something.
    may_nest = body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH
    may_have_surrogates = _SURROGATE_ESCAPE.search(body) is not None
    if may_nest or may_have_surrogates:
        _check_tree(data, check_strings=may_have_surrogates)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def _check_tree(data: dict[str, Any], *, check_strings: bool) -> None:
    """Raise a 400 for nesting beyond MAX_JSON_DEPTH or a string holding a lone surrogate.

    Iterative, so that checking depth cannot itself recurse too deeply.
    """
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            raise OpenAIError(
                f"request body is nested more than {MAX_JSON_DEPTH} levels", _param(path[:1])
            )
        if isinstance(value, dict):
            for key, item in value.items():
                if check_strings and _SURROGATE.search(key):
                    raise _surrogate_error(path + (key,))
                if isinstance(item, (dict, list)) or (check_strings and isinstance(item, str)):
                    stack.append((item, path + (key,)))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, (dict, list)) or (check_strings and isinstance(item, str)):
                    stack.append((item, path + (index,)))
        elif _SURROGATE.search(value):
            raise _surrogate_error(path)


def _surrogate_error(path: tuple[str | int, ...]) -> OpenAIError:
    param = _param(path)
    return OpenAIError(
        f"{param} holds a lone UTF-16 surrogate, which is not valid Unicode text", param
    )


def _param(path: tuple[str | int, ...]) -> str:
    """``("messages", 0, "content")`` -> ``"messages[0].content"``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out
