"""``tokenloom serve``'s flags: the server's own (``ServerArgs``) and the engine's (``EngineArgs``).

Each flag is declared once, as an ``option`` field (``tokenloom.options``);
the parser and the checks derive from it.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tokenloom.engine.args import EngineArgs
from tokenloom.options import add_cli_args, build, option, validate

from .auth import API_KEY_ENV, AccessConfig, CorsConfig
from .serving_base import DEFAULT_MAX_REQUEST_BYTES
from .tenants import load_tenants_file
from .tool_parsers import DEFAULT_TOOL_CALL_PARSER, tool_parser_names


@dataclass(frozen=True)
class ServerArgs:
    """The HTTP server's settings."""

    host: str = option("127.0.0.1", help="address to listen on")
    port: int = option(8000, ge=0, le=65535, help="port to listen on")
    max_waiting_requests: int | None = option(
        None,
        ge=0,
        help="answer 503 when this many requests are already waiting (default: no limit)",
    )
    max_request_bytes: int = option(
        DEFAULT_MAX_REQUEST_BYTES,
        ge=1,
        help="answer 413 to request bodies larger than this (default: 16 MiB)",
    )
    trust_request_chat_template: bool = option(
        False,
        help="accept a chat_template sent with a request (it is Jinja code run by the server)",
    )
    lora_modules: list[str] | None = option(
        None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) to serve from the start, each as name=path "
        "(needs --enable-lora)",
    )
    enable_auto_tool_choice: bool = option(
        False,
        help='let the model decide whether to call tools (tool_choice "auto", the default '
        "when a request has tools); its calls are found with --tool-call-parser",
    )
    tool_call_parser: str = option(
        DEFAULT_TOOL_CALL_PARSER,
        choices=tuple(tool_parser_names()),
        help="how to find tool calls in output for tool_choice auto (default: hermes, the "
        "format of the bundled tool template)",
    )
    dashboard: bool = option(
        True,
        help="serve the live dashboard at /dashboard (requests, batches, KV cache, latencies)",
    )
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = option(
        "warning", help="uvicorn's log level"
    )
    api_key: str | None = option(
        None,
        help=f"require Authorization: Bearer KEY on every route but /health, /version, the "
        f"API description and /metrics (default: ${API_KEY_ENV}, else no key; the variable "
        "keeps the key out of the process list)",
    )
    tenants: str | None = option(
        None,
        metavar="FILE",
        help="tenants file (JSON or YAML): each tenant's API keys, weight (--policy fair) "
        "and limits (concurrent requests, waiting requests, tokens per minute); see "
        "docs/multi_tenancy.md",
    )
    protect_metrics: bool = option(False, help="require the API key on /metrics too")
    ssl_keyfile: str | None = option(None, help="TLS private key file (with --ssl-certfile)")
    ssl_certfile: str | None = option(None, help="TLS certificate file (with --ssl-keyfile)")
    ssl_ca_certs: str | None = option(
        None, help="CA certificates file; clients must present a certificate it signed"
    )
    allowed_origins: list[str] | None = option(
        None,
        parse=lambda value: _name_list(value, "allowed_origins"),
        metavar="LIST",
        help='origins browsers may call from, as a JSON list (["https://app.example"], '
        '["*"]) or comma separated (default: none, no cross-origin calls)',
    )
    allowed_methods: list[str] | None = option(
        None,
        parse=lambda value: _name_list(value, "allowed_methods"),
        metavar="LIST",
        help="methods allowed cross-origin (default: GET, POST)",
    )
    allowed_headers: list[str] | None = option(
        None,
        parse=lambda value: _name_list(value, "allowed_headers"),
        metavar="LIST",
        help="request headers allowed cross-origin (default: Authorization, Content-Type)",
    )
    allow_credentials: bool = option(False, help="allow cookies on cross-origin requests")
    root_path: str | None = option(
        None,
        pattern=r"/.*[^/]|",
        requirement="a path starting with / and not ending with /",
        help="the path prefix a reverse proxy serves this server under (e.g. /llm)",
    )

    def __post_init__(self) -> None:
        validate(self)
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together: give both or neither")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name} {path!r} is not a file")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("ssl_ca_certs needs ssl_keyfile and ssl_certfile")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return build(cls, vars(args))

    def access_config(self) -> AccessConfig:
        """Keys and tenants: --api-key (else $TOKENLOOM_API_KEY) and the tenants file.
        Raises ValueError naming the flag or the file's field."""
        api_key = self.api_key if self.api_key is not None else os.environ.get(API_KEY_ENV)
        tenants = tuple(load_tenants_file(self.tenants)) if self.tenants is not None else ()
        return AccessConfig(
            api_key=api_key or None, tenants=tenants, protect_metrics=self.protect_metrics
        )

    def cors_config(self) -> CorsConfig | None:
        """None unless some origin is allowed: then browsers' preflights are answered."""
        if not self.allowed_origins:
            return None
        return CorsConfig(
            allowed_origins=tuple(self.allowed_origins),
            allowed_methods=tuple(self.allowed_methods or ("GET", "POST")),
            allowed_headers=tuple(self.allowed_headers or ("Authorization", "Content-Type")),
            allow_credentials=self.allow_credentials,
        )


def _name_list(value: object, name: str) -> list[str]:
    """A JSON list of strings, or comma-separated names (vLLM takes the JSON form)."""
    if isinstance(value, list):
        items: object = value
    elif isinstance(value, str) and value.lstrip().startswith("["):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not a valid JSON list: {exc}") from None
    elif isinstance(value, str):
        items = [part.strip() for part in value.split(",") if part.strip()]
    else:
        items = value
    if not isinstance(items, list) or not all(isinstance(i, str) and i for i in items):
        raise ValueError(f"{name} must be a list of non-empty strings, got {value!r}")
    return items


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The server's flags, then the engine's (``EngineArgs.add_cli_args``)."""
    parser.add_argument("model_tag", nargs="?", default=None, help="model path (same as --model)")
    add_cli_args(parser, ServerArgs, title="server")
    EngineArgs.add_cli_args(parser)
    return parser
