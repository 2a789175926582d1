"""The OpenAI-compatible HTTP server: ``build_app`` wires routes to an engine, ``run_server`` runs it.

Every error a client can provoke is answered with an OpenAI error body
(see errors.py); the engine dying turns into 5xx answers and a failing
``/health``, never into hanging requests.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

import tokenloom
from tokenloom.default_model import DEFAULT_MODEL_NAME
from tokenloom.engine.exceptions import EngineDeadError
from tokenloom.engine.protocol import EngineClient
from tokenloom.metrics.dashboard import DashboardFeed
from tokenloom.metrics.prometheus import PrometheusStatLogger, TenantMetrics
from tokenloom.model.hub import looks_like_hub_id

from .auth import AccessConfig, AuthMiddleware, CorsConfig, secure_openapi
from .cli_args import ServerArgs
from .dashboard import add_dashboard_routes
from .errors import OpenAIError, error_body
from .openapi import ERROR_RESPONSES, generation_responses, install_openapi, json_body
from .protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from .serving_base import (
    DEFAULT_MAX_REQUEST_BYTES,
    ClientDisconnected,
    OpenAIServing,
    parse_body,
)
from .serving_chat import OpenAIServingChat
from .serving_completion import OpenAIServingCompletion
from .serving_embedding import OpenAIServingEmbedding
from .serving_lora import LoRAAdapters
from .serving_tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    OpenAIServingTokenization,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    parse_tokenize_body,
)
from .tenants import TenantRegistry, describe
from .tool_parsers import DEFAULT_TOOL_CALL_PARSER

if TYPE_CHECKING:
    from tokenloom.engine.args import EngineArgs

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0


def default_served_model_name(model: str | None) -> str:
    """The name clients use: a Hugging Face id as given (``org/name``), else the model
    directory's name, or the .gguf file's stem."""
    if model is None:
        return DEFAULT_MODEL_NAME
    if looks_like_hub_id(model):
        return model
    path = Path(model.rstrip("/"))
    return path.stem if path.suffix == ".gguf" else path.name


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """``--lora-modules name=path ...`` as (name, path) pairs."""
    modules = []
    for value in values or ():
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora-modules takes name=path entries, got {value!r}")
        modules.append((name, path))
    return modules


def build_app(
    engine: EngineClient,
    *,
    served_model_name: str | None = None,
    max_waiting_requests: int | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    trust_request_chat_template: bool = False,
    tool_call_parser: str | None = DEFAULT_TOOL_CALL_PARSER,
    enable_auto_tool_choice: bool = False,
    reasoning_parser: str | None = None,
    registry: CollectorRegistry | None = None,
    enable_lora: bool = False,
    dashboard: bool = True,
    access: AccessConfig | None = None,
    cors: CorsConfig | None = None,
) -> FastAPI:
    """An app serving ``engine`` under ``served_model_name`` (default: the engine's name).

    Request bodies above ``max_request_bytes`` get 413. ``/metrics`` exposes
    ``registry``. Without one, a fresh registry is made and a
    ``PrometheusStatLogger`` writing to it joins ``engine.stat_loggers``;
    pass a registry only if such a logger is already attached. ``enable_lora``
    (the engine must have it too) adds the LoRA adapter endpoints.
    ``tool_call_parser`` extracts calls for ``tool_choice: "auto"``, which
    needs ``enable_auto_tool_choice``. ``reasoning_parser`` (the engine's)
    splits a reasoning model's thinking from its answer. ``dashboard`` serves
    the live dashboard at ``/dashboard``, fed by a ``DashboardFeed`` that joins
    ``engine.stat_loggers``. ``access``: API keys
    and tenants (see auth.py; None: no key needed, every request is the
    default tenant's); ``cors``: cross-origin calls allowed (None: none).
    """
    model_name = served_model_name or engine.model_name
    adapters = LoRAAdapters(engine, (model_name, engine.model_name)) if enable_lora else None
    serving = OpenAIServing(engine, model_name, max_waiting_requests, adapters)
    completions = OpenAIServingCompletion(serving)
    chat = OpenAIServingChat(
        serving,
        trust_request_chat_template,
        tool_call_parser,
        enable_auto_tool_choice=enable_auto_tool_choice,
        reasoning_parser=reasoning_parser,
    )
    tokenization = OpenAIServingTokenization(serving, chat)
    if registry is None:
        registry = CollectorRegistry()
        engine.stat_loggers.append(
            PrometheusStatLogger(
                model_name, registry, engine.max_model_len, engine.data_parallel_size
            )
        )
    metrics_registry = registry
    feed = None
    if dashboard:
        feed = DashboardFeed(model_name, engine.data_parallel_size)
        engine.stat_loggers.append(feed)
    access = access or AccessConfig()
    tenants = TenantRegistry(access.tenants, TenantMetrics(model_name, metrics_registry))

    app = FastAPI(title="tokenloom", version=tokenloom.__version__)
    app.state.serving = serving
    app.state.registry = metrics_registry
    app.state.tenants = tenants
    # The last added runs first: CORS answers preflights (and labels 401s) before auth.
    app.add_middleware(AuthMiddleware, access=access, tenants=tenants)
    if cors is not None:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors.allowed_origins),
            allow_methods=list(cors.allowed_methods),
            allow_headers=list(cors.allowed_headers),
            allow_credentials=cors.allow_credentials,
        )
    _add_error_handlers(app)
    lora_bodies: list[type[BaseModel]] = (
        [LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest] if enable_lora else []
    )
    # A pooling engine embeds: /v1/embeddings is its route (and only its, as in vLLM).
    embedding_bodies: list[type[BaseModel]] = (
        [EmbeddingRequest] if engine.pooler_config is not None else []
    )
    install_openapi(
        app,
        [
            CompletionRequest,
            ChatCompletionRequest,
            TokenizeCompletionRequest,
            TokenizeChatRequest,
            DetokenizeRequest,
            *embedding_bodies,
            *lora_bodies,
        ],
        [CompletionChunk, ChatCompletionChunk],
        None if enable_lora else sorted({model_name, engine.model_name}),
    )
    secure_openapi(app, access, tenants.has_limits())

    @app.post(
        "/v1/completions",
        openapi_extra=json_body(CompletionRequest),
        responses=generation_responses(CompletionResponse, CompletionChunk),
    )
    async def create_completion(raw_request: Request) -> Response:
        request = await parse_body(raw_request, CompletionRequest, max_request_bytes)
        return await completions.create(request, raw_request)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=json_body(ChatCompletionRequest),
        responses=generation_responses(ChatCompletionResponse, ChatCompletionChunk),
    )
    async def create_chat_completion(raw_request: Request) -> Response:
        request = await parse_body(raw_request, ChatCompletionRequest, max_request_bytes)
        return await chat.create(request, raw_request)

    @app.post(
        "/tokenize",
        openapi_extra=json_body(TokenizeCompletionRequest, TokenizeChatRequest),
        responses={200: {"model": TokenizeResponse}, **ERROR_RESPONSES},
    )
    async def tokenize(raw_request: Request) -> Response:
        request = await parse_tokenize_body(raw_request, max_request_bytes)
        return JSONResponse((await tokenization.tokenize(request)).model_dump())

    @app.post(
        "/detokenize",
        openapi_extra=json_body(DetokenizeRequest),
        responses={200: {"model": DetokenizeResponse}, **ERROR_RESPONSES},
    )
    async def detokenize(raw_request: Request) -> Response:
        request = await parse_body(raw_request, DetokenizeRequest, max_request_bytes)
        return JSONResponse((await tokenization.detokenize(request)).model_dump())

    if embedding_bodies:
        embeddings = OpenAIServingEmbedding(serving)

        @app.post(
            "/v1/embeddings",
            openapi_extra=json_body(EmbeddingRequest),
            responses={200: {"model": EmbeddingResponse}, **ERROR_RESPONSES},
        )
        async def create_embedding(raw_request: Request) -> Response:
            request = await parse_body(raw_request, EmbeddingRequest, max_request_bytes)
            return await embeddings.create(request, raw_request)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> dict[str, Any]:
        card = ModelCard(
            id=model_name,
            root=engine.model_name,
            max_model_len=engine.max_model_len,
        )
        cards = [card]
        for lora in adapters or ():
            cards.append(
                ModelCard(
                    id=lora.lora_name,
                    root=lora.lora_path,
                    parent=model_name,
                    max_model_len=engine.max_model_len,
                )
            )
        return ModelList(data=cards).model_dump()

    if adapters is not None:
        lora_adapters = adapters
        lora_responses: dict[int | str, dict[str, Any]] = {
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
            **ERROR_RESPONSES,
        }

        @app.post(
            "/v1/load_lora_adapter",
            openapi_extra=json_body(LoadLoRAAdapterRequest),
            responses=lora_responses,
        )
        async def load_lora_adapter(raw_request: Request) -> Response:
            request = await parse_body(raw_request, LoadLoRAAdapterRequest, max_request_bytes)
            await lora_adapters.load(request.lora_name, request.lora_path)
            return PlainTextResponse(
                f"Success: LoRA adapter '{request.lora_name}' added successfully."
            )

        @app.post(
            "/v1/unload_lora_adapter",
            openapi_extra=json_body(UnloadLoRAAdapterRequest),
            responses={
                **lora_responses,
                404: {"model": ErrorResponse, "description": "No adapter of that name."},
            },
        )
        async def unload_lora_adapter(raw_request: Request) -> Response:
            request = await parse_body(raw_request, UnloadLoRAAdapterRequest, max_request_bytes)
            await lora_adapters.unload(request.lora_name)
            return PlainTextResponse(
                f"Success: LoRA adapter '{request.lora_name}' removed successfully."
            )

    @app.get(
        "/health",
        response_class=Response,
        responses={
            200: {
                "description": "The engine is serving (empty body), or degraded while a "
                'crashed engine core restarts (`{"status": "degraded"}`; requests wait).'
            },
            503: {"model": ErrorResponse, "description": "The engine is dead."},
        },
    )
    async def health() -> Response:
        if engine.restarting:
            return JSONResponse({"status": "degraded"}, status_code=200)
        try:
            await asyncio.wait_for(engine.check_health(), HEALTH_TIMEOUT_S)
        except (EngineDeadError, asyncio.TimeoutError) as exc:
            body = error_body(f"engine unhealthy: {exc!r}", None, 503)
            return JSONResponse(body, status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tokenloom.__version__}

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
    )
    async def metrics() -> Response:
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    if feed is not None:
        add_dashboard_routes(app, feed)
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


def run_server(args: argparse.Namespace) -> None:
    """Build the engine from ``args`` (see ``add_serve_args``) and serve until SIGINT/SIGTERM."""
    from tokenloom.engine.args import EngineArgs

    if args.model_tag is not None:
        args.model = args.model_tag
    try:
        server_args = ServerArgs.from_cli_args(args)
        engine_args = EngineArgs.from_cli_args(args)
        server_args.access_config()  # the tenants file is checked before the model loads
    except ValueError as exc:
        raise SystemExit(f"tokenloom serve: {exc}") from None
    lora_modules = parse_lora_modules(server_args.lora_modules)
    if lora_modules and not engine_args.config.frontend_config.enable_lora:
        raise SystemExit("--lora-modules needs --enable-lora")
    asyncio.run(_serve(server_args, engine_args, lora_modules))


async def _serve(
    server_args: ServerArgs, engine_args: EngineArgs, lora_modules: list[tuple[str, str]]
) -> None:
    from tokenloom.engine.async_llm import AsyncLLM

    model_name = engine_args.config.frontend_config.served_model_name or (
        default_served_model_name(engine_args.model)
    )
    access = server_args.access_config()
    if access.tenants:
        policy = engine_args.config.scheduler_config.policy
        logger.info("tenants (policy %s): %s", policy, describe(access.tenants))
        if policy != "fair" and any(t.weight != 1 for t in access.tenants):
            logger.warning("tenant weights only matter with --policy fair (now: %s)", policy)
    try:
        engine = AsyncLLM.from_engine_args(engine_args)
    except ValueError as exc:  # an option the model cannot serve (it names the option)
        raise SystemExit(f"tokenloom serve: {exc}") from None
    try:
        app = build_app(
            engine,
            served_model_name=model_name,
            max_waiting_requests=server_args.max_waiting_requests,
            max_request_bytes=server_args.max_request_bytes,
            trust_request_chat_template=server_args.trust_request_chat_template,
            enable_lora=engine_args.config.frontend_config.enable_lora,
            tool_call_parser=server_args.tool_call_parser,
            enable_auto_tool_choice=server_args.enable_auto_tool_choice,
            reasoning_parser=engine_args.config.frontend_config.reasoning_parser,
            dashboard=server_args.dashboard,
            access=access,
            cors=server_args.cors_config(),
        )
        adapters = app.state.serving.adapters
        for name, path in lora_modules:
            try:
                await adapters.load(name, path)
            except OpenAIError as exc:
                raise SystemExit(f"--lora-modules {name}={path}: {exc.message}") from None
        config = uvicorn.Config(
            app,
            host=server_args.host,
            port=server_args.port,
            log_level=server_args.uvicorn_log_level,
            timeout_keep_alive=5,
            # Ctrl-C must not wait for long streams to finish on their own.
            timeout_graceful_shutdown=5,
            ssl_keyfile=server_args.ssl_keyfile,
            ssl_certfile=server_args.ssl_certfile,
            ssl_ca_certs=server_args.ssl_ca_certs,
            ssl_cert_reqs=ssl.CERT_REQUIRED if server_args.ssl_ca_certs else ssl.CERT_NONE,
            root_path=server_args.root_path or "",
        )
        scheme = "https" if server_args.ssl_certfile else "http"
        logger.info(
            "serving %s on %s://%s:%d%s (API key %s)",
            model_name,
            scheme,
            server_args.host,
            server_args.port,
            server_args.root_path or "",
            "required" if access.requires_key else "not required",
        )
        await uvicorn.Server(config).serve()
    finally:
        engine.shutdown()
