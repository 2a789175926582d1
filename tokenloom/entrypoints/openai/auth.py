"""Who may call the server: API keys, the tenant of each key, and the routes left open.

With ``--api-key`` (or ``TOKENLOOM_API_KEY``) or a tenants file, every route
but the open ones needs ``Authorization: Bearer KEY``; anything else is
answered 401 with an OpenAI error body. The open routes are ``/health``,
``/version`` and the API description (``/openapi.json``, ``/docs``,
``/redoc``), and ``/metrics`` unless ``--protect-metrics``. Routes are open by
name, so a route added later is protected unless it is listed here.

Keys are compared in constant time: the presented key's SHA-256 digest is
compared with every known key's digest by ``hmac.compare_digest``, with no
early exit, so neither the time taken nor a dictionary lookup tells how much
of a key matched or which tenant's it was.

``AuthMiddleware`` is plain ASGI, so streamed responses pass through
untouched. It gives every authenticated request a ``TenantLease``
(``tenants.current_lease``), which it releases when the response is over,
and puts the tenant's name in ``scope["state"]["tenant"]`` for other code.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .dashboard import is_public_path
from .errors import error_body
from .tenants import (
    DEFAULT_TENANT,
    TenantConfig,
    TenantLease,
    TenantRegistry,
    current_lease,
)

logger = logging.getLogger(__name__)

API_KEY_ENV = "TOKENLOOM_API_KEY"
OPEN_PATHS = frozenset(
    {"/health", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
)
METRICS_PATH = "/metrics"
_SECURITY_SCHEME = "bearerAuth"


class ApiKeys:
    """Known keys and their tenants; ``tenant_of`` compares in constant time."""

    def __init__(self, keys: Iterable[tuple[str, str]]) -> None:
        """``keys``: (key, tenant name) pairs."""
        self._entries = [(_digest(key), tenant) for key, tenant in keys]

    def __len__(self) -> int:
        return len(self._entries)

    def tenant_of(self, key: str) -> str | None:
        """The tenant whose key ``key`` is, or None. Every known key is compared."""
        digest = _digest(key)
        found = None
        for known, tenant in self._entries:
            if hmac.compare_digest(digest, known):
                found = tenant
        return found


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class AccessConfig:
    """Who may call the server and as which tenant; ``protect_metrics``: /metrics too."""

    api_key: str | None = None
    tenants: tuple[TenantConfig, ...] = ()
    protect_metrics: bool = False

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        for tenant in self.tenants:
            if self.api_key is not None and self.api_key in (tenant.api_keys or ()):
                raise ValueError(
                    f"api_key is also a key of tenant {tenant.name!r} in the tenants file"
                )

    @property
    def requires_key(self) -> bool:
        return self.api_key is not None or any(t.api_keys for t in self.tenants)

    def api_keys(self) -> ApiKeys | None:
        """The keys to check (None: no key needed, everyone is the default tenant)."""
        if not self.requires_key:
            return None
        pairs = [(key, t.name) for t in self.tenants for key in t.api_keys or ()]
        if self.api_key is not None:
            pairs.append((self.api_key, DEFAULT_TENANT))
        return ApiKeys(pairs)

    def is_open(self, path: str) -> bool:
        """Whether ``path`` (without the root path) answers without a key."""
        return (
            path in OPEN_PATHS
            or (path == METRICS_PATH and not self.protect_metrics)
            or is_public_path(path)
        )


def bearer_token(scope: Scope) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header, or None."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def route_path(scope: Scope) -> str:
    """The path the router matches: below ``--root-path`` when the path starts with it
    (a proxy may or may not strip it), exactly as Starlette's router cuts it."""
    path: str = scope.get("path", "/")
    root: str = scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root) :] if path[len(root)] == "/" else path


class AuthMiddleware:
    """Checks keys, finds each request's tenant and holds its lease for the response."""

    def __init__(self, app: ASGIApp, access: AccessConfig, tenants: TenantRegistry) -> None:
        self.app = app
        self.access = access
        self.keys = access.api_keys()
        self.tenants = tenants

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.access.is_open(route_path(scope)):
            await self.app(scope, receive, send)
            return
        tenant = self.tenants.default
        if self.keys is not None:
            token = bearer_token(scope)
            name = self.keys.tenant_of(token) if token is not None else None
            if name is None:
                await _refuse(scope, receive, send, token is None)
                return
            tenant = self.tenants[name]
        scope.setdefault("state", {})["tenant"] = tenant.name
        lease = TenantLease(tenant)
        reset = current_lease.set(lease)
        try:
            await self.app(scope, receive, send)
        finally:
            current_lease.reset(reset)
            lease.release()


async def _refuse(scope: Scope, receive: Receive, send: Send, missing: bool) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})  # policy violation
        return
    message = "missing API key: send Authorization: Bearer KEY" if missing else "invalid API key"
    response = JSONResponse(
        error_body(message, None, 401), status_code=401, headers={"WWW-Authenticate": "Bearer"}
    )
    await response(scope, receive, send)


def secure_openapi(app: FastAPI, access: AccessConfig, rate_limited: bool) -> None:
    """Declare the bearer key in ``app.openapi()``: the scheme, and on every protected
    operation its use and the 401 answer (and 429 on POSTs when tenants have limits)."""
    if not access.requires_key and not rate_limited:
        return
    inner: Callable[[], dict[str, Any]] = app.openapi
    secured: list[dict[str, Any]] = []

    def openapi() -> dict[str, Any]:
        schema = inner()
        if secured and secured[0] is schema:
            return schema
        error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        if access.requires_key:
            schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
            schemes[_SECURITY_SCHEME] = {"type": "http", "scheme": "bearer"}
        for path, operations in schema.get("paths", {}).items():
            if access.is_open(path):
                continue
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                if access.requires_key:
                    operation["security"] = [{_SECURITY_SCHEME: []}]
                    responses["401"] = {
                        "description": "Missing or invalid API key.",
                        "content": error,
                    }
                if rate_limited and method == "post":
                    responses["429"] = {
                        "description": "The tenant is over a limit; see the Retry-After header.",
                        "headers": {"Retry-After": {"schema": {"type": "integer"}}},
                        "content": error,
                    }
        secured[:] = [schema]
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


@dataclass(frozen=True)
class CorsConfig:
    """Cross-origin calls from browsers: who, with which methods and headers."""

    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...] = ("GET", "POST")
    allowed_headers: tuple[str, ...] = ("Authorization", "Content-Type")
    allow_credentials: bool = False
