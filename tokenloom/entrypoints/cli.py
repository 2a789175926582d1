"""The ``tokenloom`` command: serve, generate, chat, disagg-proxy (and bench when installed).

``generate`` runs offline through ``LLM`` (one prompt, or a JSONL file with a
progress bar); ``chat`` is an interactive loop on ``AsyncLLM`` that prints
tokens as they arrive; ``serve`` starts the OpenAI-compatible server.
Conversations go through the engine's chat template (``--chat-template``, else
the model's), the same code the server and ``LLM.chat`` use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from tokenloom.engine.protocol import ChatOptions, PromptType
from tokenloom.jsonl import iter_jsonl
from tokenloom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenloom.engine.args import EngineArgs
    from tokenloom.engine.input_processor import InputProcessor
    from tokenloom.engine.protocol import EngineClient

# ----------------------------------------------------------------- parsing


def build_parser() -> argparse.ArgumentParser:
    from tokenloom.engine.args import EngineArgs
    from tokenloom.entrypoints.disagg_proxy import add_proxy_args
    from tokenloom.entrypoints.openai.cli_args import add_serve_args

    parser = argparse.ArgumentParser(
        prog="tokenloom", description="A small LLM inference and serving engine."
    )
    parser.add_argument("--log-level", default="INFO", help="Python logging level")
    subparsers = parser.add_subparsers(dest="command", required=True)

    serve = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_serve_args(serve)
    serve.set_defaults(func=_cmd_serve)

    generate = subparsers.add_parser(
        "generate", help="complete a prompt, or every line of a JSONL file"
    )
    generate.add_argument("prompt", nargs="?", help="the prompt (or use --input)")
    generate.add_argument(
        "--input", type=Path, help='JSONL file, one {"prompt": ...} or {"messages": [...]} a line'
    )
    generate.add_argument("--output", type=Path, help="JSONL results (default: stdout)")
    generate.add_argument(
        "--chat",
        action="store_true",
        help="send PROMPT as a user message through the chat template",
    )
    _add_sampling_args(generate, default_max_tokens=128)
    EngineArgs.add_cli_args(generate)
    generate.set_defaults(func=_cmd_generate, seed=None)

    chat = subparsers.add_parser("chat", help="interactive chat, streaming the replies")
    chat.add_argument("--system", help="system prompt")
    _add_sampling_args(chat, default_max_tokens=512)
    EngineArgs.add_cli_args(chat)
    chat.set_defaults(func=_cmd_chat, seed=None)

    proxy = subparsers.add_parser(
        "disagg-proxy",
        help="one OpenAI endpoint in front of a prefill and a decode engine "
        "(prefill/decode disaggregation)",
    )
    add_proxy_args(proxy)
    proxy.set_defaults(func=_cmd_disagg_proxy)

    from tokenloom.simulator.cli import register_simulate_command

    register_simulate_command(subparsers)

    try:
        from tokenloom.bench.cli import register_bench_commands
    except ImportError:
        pass  # the benchmark tools are optional
    else:
        register_bench_commands(subparsers)
    return parser


def _add_sampling_args(parser: argparse.ArgumentParser, default_max_tokens: int) -> None:
    """Sampling flags. ``--seed`` (an engine flag) doubles as the per-request seed."""
    group = parser.add_argument_group("sampling")
    d = SamplingParams
    group.add_argument("--max-tokens", type=int, default=default_max_tokens)
    group.add_argument("--min-tokens", type=int, default=d.min_tokens)
    group.add_argument("--temperature", type=float, default=d.temperature)
    group.add_argument("--top-p", type=float, default=d.top_p)
    group.add_argument("--top-k", type=int, default=d.top_k)
    group.add_argument("--min-p", type=float, default=d.min_p)
    group.add_argument("--presence-penalty", type=float, default=d.presence_penalty)
    group.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty)
    group.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty)
    group.add_argument("--stop", action="append", help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")
    group.add_argument("--n", type=int, default=d.n, help="completions per prompt")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        n=args.n,
        seed=args.seed,
    )


def _engine_args(args: argparse.Namespace) -> EngineArgs:
    from tokenloom.engine.args import EngineArgs

    seed = args.seed if args.seed is not None else 0  # None: unseeded requests
    return EngineArgs.from_cli_args(argparse.Namespace(**{**vars(args), "seed": seed}))


# ----------------------------------------------------------------- commands


def _cmd_serve(args: argparse.Namespace) -> int:
    from tokenloom.entrypoints.openai.server import run_server

    try:
        run_server(args)
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled; the engine is down
        pass
    return 0


def _cmd_disagg_proxy(args: argparse.Namespace) -> int:
    from tokenloom.entrypoints.disagg_proxy import run_proxy

    try:
        run_proxy(args)
    except KeyboardInterrupt:
        pass
    return 0


def read_requests(path: Path) -> list[dict[str, Any]]:
    """JSONL records, each with a string ``prompt`` or a list of ``messages``."""
    records = []
    for number, record in iter_jsonl(path):
        prompt_ok = isinstance(record, dict) and isinstance(record.get("prompt"), str)
        messages_ok = isinstance(record, dict) and isinstance(record.get("messages"), list)
        if not (prompt_ok or messages_ok):
            raise ValueError(
                f'{path}:{number}: each line needs a string "prompt" or a list "messages"'
            )
        records.append(record)
    return records


def build_prompts(
    input_processor: InputProcessor, records: list[dict[str, Any]]
) -> list[PromptType]:
    """The prompt of each record: its text, or its ``messages`` through the chat template."""
    prompts: list[PromptType] = []
    for record in records:
        if "messages" in record:
            prompts.append(input_processor.render_chat(record["messages"], ChatOptions()).token_ids)
        else:
            prompts.append(record["prompt"])
    return prompts


def _cmd_generate(args: argparse.Namespace) -> int:
    from tokenloom.engine.llm import LLM

    if (args.prompt is None) == (args.input is None):
        print("tokenloom generate: give either a PROMPT or --input FILE", file=sys.stderr)
        return 2
    try:
        params = sampling_params_from_args(args)
        if args.input is not None:
            records = read_requests(args.input)
        elif args.chat:
            records = [{"messages": [{"role": "user", "content": args.prompt}]}]
        else:
            records = [{"prompt": args.prompt}]
        llm = LLM.from_engine_args(_engine_args(args))
        prompts = build_prompts(llm.input_processor, records)
        results = llm.generate(prompts, params, use_tqdm=args.input is not None)
    except (ValueError, OSError) as exc:
        print(f"tokenloom generate: {exc}", file=sys.stderr)
        return 2
    if args.input is None and args.output is None:
        for i, out in enumerate(results[0].outputs):
            if len(results[0].outputs) > 1:
                print(f"--- completion {i}")
            print(out.text)
        return 0
    with _open_output(args.output) as sink:
        for record, result in zip(records, results, strict=True):
            outputs = [
                {"text": o.text, "finish_reason": o.finish_reason, "num_tokens": len(o.token_ids)}
                for o in result.outputs
            ]
            line = {
                **record,
                "text": outputs[0]["text"],
                "outputs": outputs,
                "num_prompt_tokens": len(result.prompt_token_ids),
            }
            sink.write(json.dumps(line, ensure_ascii=False) + "\n")
    return 0


class _open_output:
    """A file to write, or stdout (left open) when no path is given."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.file: TextIO = sys.stdout

    def __enter__(self) -> TextIO:
        if self.path is not None:
            self.file = self.path.open("w", encoding="utf-8")
        return self.file

    def __exit__(self, *exc: object) -> None:
        if self.path is not None:
            self.file.close()


def _cmd_chat(args: argparse.Namespace) -> int:
    try:
        params = sampling_params_from_args(args)
        engine_args = _engine_args(args)
    except ValueError as exc:
        print(f"tokenloom chat: {exc}", file=sys.stderr)
        return 2
    asyncio.run(_chat_loop(engine_args, params, args.system))
    return 0


async def _chat_loop(engine_args: EngineArgs, params: SamplingParams, system: str | None) -> None:
    from tokenloom.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(engine_args)
    print("tokenloom chat: /exit or Ctrl-D to quit", file=sys.stderr)
    try:
        await chat_session(engine, params, system, lambda: asyncio.to_thread(input, "> "))
    finally:
        engine.shutdown()


async def chat_session(
    engine: EngineClient,
    params: SamplingParams,
    system: str | None,
    read_line: Callable[[], Awaitable[str]],
    out: TextIO | None = None,
) -> list[dict[str, str]]:
    """Read user turns until /exit or EOF, streaming each reply; returns the conversation.

    Only the first of ``n`` completions is shown and kept in the history. A turn
    the engine refuses (say, a conversation grown past the context) is dropped
    with a message, and the session goes on.
    """
    out = out or sys.stdout
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = await read_line()
        except EOFError:
            print(file=out)
            return history
        if line.strip() in ("/exit", "/quit"):
            return history
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        reply: list[str] = []
        try:
            rendered = await engine.render_chat(list(history), ChatOptions())
            request_id = f"chat-{uuid.uuid4().hex}"
            async for output in engine.generate(rendered.token_ids, params, request_id, delta=True):
                piece = "".join(o.text for o in output.outputs if o.index == 0)
                print(piece, end="", flush=True, file=out)
                reply.append(piece)
            print(file=out)
        except ValueError as exc:
            history.pop()
            print(f"error: {exc}", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": "".join(reply)})


# ----------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
