"""The ``tokenloom`` CLI: flag parsing, the chat loop and JSONL prompts through the
engine's chat templating, and ``tokenloom generate`` as a user runs it (a subprocess
on the default model)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tokenloom.engine.input_processor import InputProcessor
from tokenloom.engine.protocol import ChatOptions, RenderedChat
from tokenloom.entrypoints.cli import (
    build_parser,
    build_prompts,
    chat_session,
    read_requests,
    sampling_params_from_args,
)
from tokenloom.entrypoints.openai.cli_args import ServerArgs
from tokenloom.entrypoints.openai.server import run_server
from tokenloom.model.tokenizer import load_tokenizer
from tokenloom.outputs import CompletionOutput, RequestOutput
from tokenloom.sampling_params import SamplingParams

from .server_utils import REPO_ROOT

# A small chat template, so tests can tell it was the engine's that rendered.
ROLES = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"

SMALL_ENGINE = ["--max-model-len", "256", "--num-blocks", "64", "--log-level", "WARNING"]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="2")
    # --log-level belongs before the subcommand.
    engine = [a for a in SMALL_ENGINE if a not in ("--log-level", "WARNING")]
    command = [sys.executable, "-m", "tokenloom.entrypoints.cli", "--log-level", "WARNING"]
    return subprocess.run(
        [*command, *args, *engine],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        env=env,
    )


def test_generate_flags_become_sampling_params() -> None:
    args = build_parser().parse_args(
        ["generate", "hi", "--max-tokens", "5", "--temperature", "0", "--stop", "x", "--seed", "3"]
    )
    params = sampling_params_from_args(args)
    assert (params.max_tokens, params.temperature, params.stop, params.seed) == (5, 0.0, ["x"], 3)
    unseeded = sampling_params_from_args(build_parser().parse_args(["generate", "hi"]))
    assert unseeded.seed is None


def test_serve_flags_reach_the_server_and_engine_args() -> None:
    args = build_parser().parse_args(
        ["serve", "/m", "--port", "9000", "--max-waiting-requests", "3", "-tp", "2"]
        + ["--uvicorn-log-level", "info", "--no-enable-prefix-caching"]
    )
    server = ServerArgs.from_cli_args(args)
    assert (server.host, server.port, server.max_waiting_requests) == ("127.0.0.1", 9000, 3)
    assert server.uvicorn_log_level == "info" and server.trust_request_chat_template is False
    assert args.model_tag == "/m" and args.tensor_parallel_size == 2
    assert args.enable_prefix_caching is False


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-request-bytes", "0"], "max_request_bytes must be an integer >= 1, got 0"),
        (["--max-waiting-requests", "-1"], "max_waiting_requests must be an integer >= 0"),
        (["--port", "70000"], "port must be an integer in [0, 65535], got 70000"),
        (["--max-num-seqs", "0"], "max_num_seqs must be an integer >= 1, got 0"),
    ],
)
def test_bad_serve_flags_stop_before_the_engine_starts(flags: list[str], message: str) -> None:
    args = build_parser().parse_args(["serve", *flags])
    with pytest.raises(SystemExit, match="^tokenloom serve: " + re.escape(message)):
        run_server(args)


def test_read_requests_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    assert len(read_requests(path)) == 2
    path.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=":2:"):
        read_requests(path)


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_generate_one_prompt() -> None:
    result = run_cli(
        "generate", "The capital of France is", "--max-tokens", "4", "--temperature", "0"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), result.stderr[-3000:]


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_generate_jsonl_file(tmp_path: Path, default_model_path: Path) -> None:
    source = tmp_path / "prompts.jsonl"
    records = [
        {"id": 1, "prompt": "One, two,"},
        {"id": 2, "messages": [{"role": "user", "content": "Say hello."}]},
    ]
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    target = tmp_path / "results.jsonl"
    template = tmp_path / "chat.jinja"
    template.write_text(ROLES, encoding="utf-8")
    result = run_cli(
        "generate",
        "--input",
        str(source),
        "--output",
        str(target),
        "--max-tokens",
        "3",
        "--temperature",
        "0",
        "--chat-template",
        str(template),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in target.read_text().splitlines()]
    assert [line["id"] for line in lines] == [1, 2]
    for line in lines:
        assert line["text"] and line["outputs"][0]["num_tokens"] <= 3
    assert "messages" in lines[1] and "prompt" in lines[0]
    tokenizer = load_tokenizer(default_model_path)
    assert lines[0]["num_prompt_tokens"] == len(tokenizer.encode("One, two,"))
    # The messages went through --chat-template, not the model's own template.
    rendered = tokenizer.encode("user: Say hello.\n", add_special_tokens=False)
    assert lines[1]["num_prompt_tokens"] == len(rendered)


@pytest.mark.timeout(60)
def test_generate_needs_exactly_one_source() -> None:
    result = run_cli("generate")
    assert result.returncode == 2
    assert "PROMPT or --input" in result.stderr


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path) -> Any:
    return load_tokenizer(default_model_path)


class ChatEngine:
    """The part of ``EngineClient`` the chat loop uses: chats rendered by the engine's
    InputProcessor (with ``ROLES`` as its --chat-template); replies are "a", "b", ..."""

    def __init__(self, tokenizer: Any, max_model_len: int = 64) -> None:
        self.inputs = InputProcessor(
            tokenizer, max_model_len, len(tokenizer), [2], chat_template=ROLES
        )
        self.rendered: list[RenderedChat] = []
        self.started = self.finished = 0

    async def render_chat(
        self, messages: list[dict[str, Any]], options: ChatOptions
    ) -> RenderedChat:
        rendered = self.inputs.render_chat(messages, options)
        self.rendered.append(rendered)
        return rendered

    async def generate(
        self, prompt: list[int], params: SamplingParams, request_id: str, *, delta: bool = False
    ) -> AsyncIterator[RequestOutput]:
        self.inputs.process(request_id, prompt, params)  # the engine's own validation
        self.started += 1
        count = params.max_tokens or 1
        for i in range(count):
            piece = chr(ord("a") + i)
            out = CompletionOutput(0, piece, [i], "length" if i == count - 1 else None)
            yield RequestOutput(request_id, None, prompt, [out], finished=i == count - 1)
        self.finished += 1


async def test_chat_session_keeps_history_and_streams(tokenizer: Any) -> None:
    engine = ChatEngine(tokenizer)
    turns = iter(["hi", "", "again", "/exit", "never read"])

    async def read_line() -> str:
        return next(turns)

    out = io.StringIO()
    history = await chat_session(
        engine,
        SamplingParams(max_tokens=2),
        "be brief",
        read_line,
        out,
    )
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user", "assistant"]
    assert history[2]["content"] == "ab"
    assert out.getvalue() == "ab\nab\n"
    # Each turn went through the engine's template, with the whole conversation so far.
    assert [r.text for r in engine.rendered] == [
        "system: be brief\nuser: hi\n",
        "system: be brief\nuser: hi\nassistant: ab\nuser: again\n",
    ]
    assert engine.finished == engine.started == 2


async def test_chat_session_ends_on_eof_and_survives_a_refused_turn(tokenizer: Any) -> None:
    engine = ChatEngine(tokenizer, max_model_len=32)
    turns = iter(["x " * 100, "bad \udc80", "ok"])

    async def read_line() -> str:
        try:
            return next(turns)
        except StopIteration:
            raise EOFError from None

    history = await chat_session(
        engine,
        SamplingParams(max_tokens=1),
        None,
        read_line,
        io.StringIO(),
    )
    # The over-long turn (context 32) and the unencodable one were refused and left out.
    assert history == [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "a"}]


def test_jsonl_messages_go_through_the_engine_template(tokenizer: Any) -> None:
    inputs = InputProcessor(tokenizer, 64, len(tokenizer), [2], chat_template=ROLES)
    records = [
        {"prompt": "One, two,"},
        {"messages": [{"role": "user", "content": "Say hello."}]},
    ]
    prompts = build_prompts(inputs, records)
    assert prompts[0] == "One, two,"
    assert prompts[1] == tokenizer.encode("user: Say hello.\n", add_special_tokens=False)
    with pytest.raises(ValueError, match=r"^messages\[0\]\.role"):
        build_prompts(inputs, [{"messages": [{"content": "no role"}]}])
