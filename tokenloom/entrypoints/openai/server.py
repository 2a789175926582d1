"""The OpenAI-compatible HTTP server: ``build_app`` wires routes to an engine, ``run_server`` runs it.

Every error a client can provoke is answered with an OpenAI error body
(see errors.py); the engine dying turns into 5xx answers and a failing
``/health``, never into hanging requests.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import tokenloom
from tokenloom.engine.exceptions import EngineDeadError
from tokenloom.metrics.prometheus import PrometheusStatLogger

from .errors import OpenAIError, error_body
from .protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from .serving_base import ClientDisconnected, OpenAIServing, parse_body
from .serving_chat import OpenAIServingChat
from .serving_completion import OpenAIServingCompletion

if TYPE_CHECKING:
    from tokenloom.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
HEALTH_TIMEOUT_S = 5.0


def default_served_model_name(model: str | None) -> str:
    """The name clients use: the model directory's name, or the .gguf file's stem."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model.rstrip("/"))
    return path.stem if path.suffix == ".gguf" else path.name


def build_app(
    engine: AsyncLLM,
    *,
    served_model_name: str | None = None,
    max_waiting_requests: int | None = None,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    """An app serving ``engine`` under ``served_model_name`` (default: the engine's name).

    ``/metrics`` exposes ``registry``. Without one, a fresh registry is made and
    a ``PrometheusStatLogger`` writing to it joins ``engine.stat_loggers``;
    pass a registry only if such a logger is already attached.
    """
    model_name = served_model_name or engine.model_name
    serving = OpenAIServing(engine, model_name, max_waiting_requests)
    completions = OpenAIServingCompletion(serving)
    chat = OpenAIServingChat(serving)
    if registry is None:
        registry = CollectorRegistry()
        stat_loggers = getattr(engine, "stat_loggers", None)
        if stat_loggers is not None:
            stat_loggers.append(PrometheusStatLogger(model_name, registry, engine.max_model_len))
    metrics_registry = registry

    app = FastAPI(title="tokenloom", version=tokenloom.__version__)
    app.state.serving = serving
    app.state.registry = metrics_registry
    _add_error_handlers(app)

    @app.post("/v1/completions")
    async def create_completion(raw_request: Request) -> Response:
        request = await parse_body(raw_request, CompletionRequest)
        return await completions.create(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw_request: Request) -> Response:
        request = await parse_body(raw_request, ChatCompletionRequest)
        return await chat.create(request, raw_request)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        card = ModelCard(
            id=model_name,
            root=engine.model_name,
            max_model_len=engine.max_model_len,
        )
        return ModelList(data=[card]).model_dump()

    @app.get("/health")
    async def health() -> Response:
        try:
            await asyncio.wait_for(engine.check_health(), HEALTH_TIMEOUT_S)
        except (EngineDeadError, asyncio.TimeoutError) as exc:
            body = error_body(f"engine unhealthy: {exc!r}", None, 503)
            return JSONResponse(body, status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tokenloom.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> Response:
        return exc.response()

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse(error_body(str(exc.detail), None, exc.status_code), exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)
        return JSONResponse(error_body(f"internal error: {exc!r}", None, 500), 500)


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Server flags; the engine flags come from ``EngineArgs.add_cli_args``."""
    from tokenloom.engine.args import EngineArgs

    parser.add_argument("model_tag", nargs="?", default=None, help="model path (same as --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 when this many requests are already waiting (default: no limit)",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    EngineArgs.add_cli_args(parser)
    return parser


def run_server(args: argparse.Namespace) -> None:
    """Build the engine from ``args`` (see ``add_serve_args``) and serve until SIGINT/SIGTERM."""
    asyncio.run(_serve(args))


async def _serve(args: argparse.Namespace) -> None:
    from tokenloom.engine.args import EngineArgs
    from tokenloom.engine.async_llm import AsyncLLM

    if args.model_tag is not None:
        args.model = args.model_tag
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise SystemExit("--max-waiting-requests must be >= 0")
    engine_args = EngineArgs.from_cli_args(args)
    model_name = engine_args.served_model_name or default_served_model_name(engine_args.model)
    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        app = build_app(
            engine, served_model_name=model_name, max_waiting_requests=args.max_waiting_requests
        )
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            timeout_keep_alive=5,
            # Ctrl-C must not wait for long streams to finish on their own.
            timeout_graceful_shutdown=5,
        )
        logger.info("serving %s on http://%s:%d", model_name, args.host, args.port)
        await uvicorn.Server(config).serve()
    finally:
        engine.shutdown()
