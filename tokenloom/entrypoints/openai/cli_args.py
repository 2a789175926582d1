"""``tokenloom serve``'s flags: the server's own (``ServerArgs``) and the engine's (``EngineArgs``).

Each flag is declared once, as an ``option`` field (``tokenloom.options``);
the parser and the checks derive from it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

from tokenloom.engine.args import EngineArgs
from tokenloom.options import add_cli_args, build, option, validate

from .serving_base import DEFAULT_MAX_REQUEST_BYTES
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

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return build(cls, vars(args))


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The server's flags, then the engine's (``EngineArgs.add_cli_args``)."""
    parser.add_argument("model_tag", nargs="?", default=None, help="model path (same as --model)")
    add_cli_args(parser, ServerArgs, title="server")
    EngineArgs.add_cli_args(parser)
    return parser
