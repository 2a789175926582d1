"""``tokenloom disagg-proxy``: one OpenAI endpoint in front of a prefill and a decode engine.

Prefill/decode disaggregation (docs/kv_connectors.md): each completion or
chat completion goes first to the prefill engine (a ``tokenloom serve`` with
a ``kv_producer`` connector) with ``max_tokens=1``, ``stream: false`` and
``kv_transfer_params: {"do_remote_decode": true}``; its answer's
``kv_transfer_params`` say where the prompt's KV waits. Then the original
request goes to the decode engine (a ``kv_consumer``) with those params; the
decode engine pulls the KV and its answer, streamed or not, is passed back
unchanged.

Failures never hang a request: a prefill engine that is down, slow (past
``--prefill-timeout``) or failing (5xx) is skipped, and the decode engine
prefills the prompt itself; a prefill engine that rejects the request (4xx)
answers the client; a decode engine that cannot be reached gives a 502 with
an OpenAI-style error naming it.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from tokenloom.options import add_cli_args, build, option, validate

logger = logging.getLogger(__name__)

_ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class ProxyArgs:
    """The proxy's settings."""

    prefill: str = option(
        "", help="base URL of the prefill engine (kv_role kv_producer), e.g. http://host:8100"
    )
    decode: str = option(
        "", help="base URL of the decode engine (kv_role kv_consumer), e.g. http://host:8200"
    )
    host: str = option("127.0.0.1", help="address to listen on")
    port: int = option(8000, ge=0, le=65535, help="port to listen on")
    prefill_timeout: float = option(
        60.0,
        gt=0,
        help="seconds the prefill may take before the decode engine prefills the prompt itself",
    )
    decode_timeout: float = option(
        600.0, gt=0, help="seconds the decode engine may stay silent before the request fails"
    )

    def __post_init__(self) -> None:
        validate(self)
        for name in ("prefill", "decode"):
            url = getattr(self, name)
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{name} must be an http:// or https:// URL, got {url!r}")
            object.__setattr__(self, name, url.rstrip("/"))


def _error(status: int, message: str, kind: str = "server_error") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status_code=status,
    )


class DisaggProxy:
    """The routes' logic; one ``httpx.AsyncClient`` for both engines."""

    def __init__(self, args: ProxyArgs, client: httpx.AsyncClient | None = None) -> None:
        self.args = args
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(args.decode_timeout))
        # Requests the decode engine had to prefill itself, for the log and tests.
        self.num_fallbacks = 0

    async def _prefill(self, path: str, body: dict[str, Any]) -> dict[str, Any] | Response | None:
        """The prefill engine's ``kv_transfer_params``; a Response to pass on (it
        rejected the request); None when the decode engine must prefill itself."""
        prefill_body = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        prefill_body.pop("stream_options", None)
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        url = self.args.prefill + path
        try:
            response = await self.client.post(
                url, json=prefill_body, timeout=self.args.prefill_timeout
            )
        except httpx.HTTPError as exc:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            self._fallback(f"prefill engine {url} failed ({reason})")
            return None
        if response.status_code >= 500:
            self._fallback(f"prefill engine {url} answered {response.status_code}")
            return None
        if response.status_code != 200:
            return Response(
                response.content,
                status_code=response.status_code,
                media_type=response.headers.get("content-type"),
            )
        params = response.json().get("kv_transfer_params")
        if not isinstance(params, dict):
            self._fallback(f"prefill engine {url} returned no kv_transfer_params")
            return None
        return params

    def _fallback(self, reason: str) -> None:
        self.num_fallbacks += 1
        logger.warning("%s; the decode engine prefills the prompt itself", reason)

    async def forward(self, path: str, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(400, "the request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        body.pop("kv_transfer_params", None)
        params = None
        if body.get("n", 1) == 1:  # n > 1 would pull one prefill n times
            prefilled = await self._prefill(path, body)
            if isinstance(prefilled, Response):
                return prefilled
            params = prefilled
        decode_body = dict(body)
        if params is not None:
            decode_body["kv_transfer_params"] = params
        url = self.args.decode + path
        try:
            upstream = await self.client.send(
                self.client.build_request("POST", url, json=decode_body), stream=True
            )
        except httpx.HTTPError as exc:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            logger.error("decode engine %s failed: %s", url, reason)
            return _error(502, f"decode engine {url} failed: {reason}")
        return StreamingResponse(
            upstream.aiter_raw(),
            status_code=upstream.status_code,
            media_type=upstream.headers.get("content-type"),
            background=BackgroundTask(upstream.aclose),
        )

    async def health(self) -> Response:
        """200 while the decode engine is healthy (the prefill engine is optional)."""
        states = {}
        for name in ("prefill", "decode"):
            try:
                response = await self.client.get(getattr(self.args, name) + "/health", timeout=5)
                states[name] = "ok" if response.status_code == 200 else str(response.status_code)
            except httpx.HTTPError as exc:
                states[name] = type(exc).__name__
        return JSONResponse(states, status_code=200 if states["decode"] == "ok" else 503)

    async def models(self) -> Response:
        try:
            response = await self.client.get(self.args.decode + "/v1/models", timeout=10)
        except httpx.HTTPError as exc:
            return _error(502, f"decode engine {self.args.decode} failed: {exc}")
        return Response(response.content, response.status_code, media_type="application/json")


def build_app(args: ProxyArgs, client: httpx.AsyncClient | None = None) -> FastAPI:
    proxy = DisaggProxy(args, client)
    app = FastAPI(title="tokenloom disaggregation proxy")
    app.state.proxy = proxy

    def forwarder(path: str):  # type: ignore[no-untyped-def]
        async def route(request: Request) -> Response:
            return await proxy.forward(path, request)

        return route

    for path in _ROUTES:
        app.add_api_route(path, forwarder(path), methods=["POST"], include_in_schema=False)
    app.add_api_route("/health", proxy.health, methods=["GET"])
    app.add_api_route("/v1/models", proxy.models, methods=["GET"])
    return app


def add_proxy_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_cli_args(parser, ProxyArgs, title="proxy")
    return parser


def run_proxy(namespace: argparse.Namespace) -> None:
    import uvicorn

    try:
        args = build(ProxyArgs, vars(namespace))
    except ValueError as exc:
        raise SystemExit(f"tokenloom disagg-proxy: {exc}") from None
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    logger.info(
        "disaggregation proxy on http://%s:%d: prefill %s, decode %s",
        args.host,
        args.port,
        args.prefill,
        args.decode,
    )
    uvicorn.run(build_app(args), host=args.host, port=args.port, log_level="warning")
