"""OpenAI-style error bodies and the mapping from Python errors to them.

Every failure a client can cause ends as ``{"error": {"message", "type",
"param", "code"}}`` with ``param`` naming the offending request field, so
that the official ``openai`` client raises the matching exception class.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# SamplingParams and config messages start with the field name ("top_p must be ...").
_LEADING_FIELD = re.compile(r"^([a-z_][a-z0-9_]*)\b")
_SURROGATES = re.compile("[\ud800-\udfff]")


class OpenAIError(Exception):
    """An error to report to the client with an HTTP status, an OpenAI body and
    optional headers (``Retry-After`` with a 429)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        status: int = 400,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.headers = dict(headers) if headers else None

    def body(self) -> dict[str, dict[str, object]]:
        return error_body(self.message, self.param, self.status)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, param: str | None, status: int) -> dict[str, dict[str, object]]:
    err_type = _ERROR_TYPES.get(
        status, "BadRequestError" if status < 500 else "InternalServerError"
    )
    if param is not None:
        param = _printable(param)
    error: dict[str, object] = {
        "message": _printable(message),
        "type": err_type,
        "param": param,
        "code": status,
    }
    return {"error": error}


def _printable(text: str) -> str:
    """``text`` without lone surrogates, which a request can smuggle in and UTF-8 cannot encode."""
    return text if text.isascii() else _SURROGATES.sub("\ufffd", text)


def from_value_error(
    exc: ValueError,
    known_fields: Mapping[str, str],
    default_param: str | None,
) -> OpenAIError:
    """A 400 for a ValueError whose message starts with a field name.

    ``known_fields`` maps internal names (SamplingParams fields) to request
    field names; a message naming none of them gets ``default_param`` (for
    example ``"prompt"`` for the engine's prompt checks).
    """
    message = str(exc) or exc.__class__.__name__
    match = _LEADING_FIELD.match(message)
    param = default_param
    if match and match.group(1) in known_fields:
        param = known_fields[match.group(1)]
    return OpenAIError(message, param)


def from_validation_error(exc: ValidationError) -> OpenAIError:
    """A 400 naming the first invalid field (top-level name, plus list index if any)."""
    errors = exc.errors(include_url=False)
    if not errors:
        return OpenAIError(str(exc))
    first = errors[0]
    loc = first.get("loc", ())
    param = _loc_to_param(loc)
    meant = _member_meant(errors)
    if meant is not None:
        first = meant
        param = _loc_to_param(_without_member_tags(meant["loc"]))
    where = f" ({param})" if param else ""
    return OpenAIError(f"invalid request{where}: {first.get('msg', 'invalid value')}", param)


def _loc_to_param(loc: tuple[int | str, ...]) -> str | None:
    """``("messages", 0, "role")`` -> ``"messages[0].role"``.

    pydantic puts union members into locations (``"str"``, ``"list[int]"``,
    ``"TextContentPart"``); the path stops there, as they are not request fields.
    """
    param = ""
    for part in loc:
        if isinstance(part, int):
            if not param:
                break
            param += f"[{part}]"
        elif _FIELD_NAME.fullmatch(part) and part not in _TYPE_NAMES:
            param += f".{part}" if param else part
        else:
            break
    return param or None


def _member_meant(errors: list[Any]) -> Any | None:
    """The error of the union member a value was meant for: when it is not of the
    first member's type (``content`` not a string), a deeper error below the same
    field (``content: [{"type": "image_url"}]`` with no ``image_url``) is the one to
    report."""
    loc = errors[0].get("loc", ())
    if len(errors) < 2 or not loc or not errors[0].get("type", "").endswith("_type"):
        return None
    if _FIELD_NAME.fullmatch(str(loc[-1])) and loc[-1] not in _TYPE_NAMES:
        return None  # not a union member
    field = loc[:-1]
    deeper = [e for e in errors[1:] if e["loc"][: len(field)] == field and len(e["loc"]) > len(loc)]
    # Several members with deeper errors (a list of strings or of ints?): no telling.
    if len({e["loc"][len(field)] for e in deeper}) != 1:
        return None
    return deeper[0]


def _without_member_tags(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """``("messages", 0, "content", "list[tagged-union[...]]", 1, "image_url",
    "image_url", "url")`` -> ``("messages", 0, "content", 1, "image_url", "url")``:
    union member names out, and a discriminated union's tag (repeated after a list
    index, before the field of the same name) once."""
    out: list[int | str] = []
    for i, part in enumerate(loc):
        if isinstance(part, str) and not _FIELD_NAME.fullmatch(part):
            continue
        if (
            isinstance(part, str)
            and out
            and isinstance(out[-1], int)
            and i + 1 < len(loc)
            and loc[i + 1] == part
        ):
            continue
        out.append(part)
    return tuple(out)


_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "none", "list", "dict", "literal"})
