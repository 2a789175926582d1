"""OpenAI-style error bodies and the mapping from Python errors to them.

Every failure a client can cause ends as ``{"error": {"message", "type",
"param", "code"}}`` with ``param`` naming the offending request field, so
that the official ``openai`` client raises the matching exception class.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from fastapi.responses import JSONResponse
from pydantic import ValidationError

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# SamplingParams and config messages start with the field name ("top_p must be ...").
_LEADING_FIELD = re.compile(r"^([a-z_][a-z0-9_]*)\b")
_SURROGATES = re.compile("[\ud800-\udfff]")


class OpenAIError(Exception):
    """An error to report to the client with an HTTP status and an OpenAI body."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status

    def body(self) -> dict[str, dict[str, object]]:
        return error_body(self.message, self.param, self.status)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


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


_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "none", "list", "dict", "literal"})
