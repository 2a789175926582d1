"""The ``tokenloom`` CLI: flag parsing, the chat loop on a fake engine, and
``tokenloom generate`` as a user runs it (a subprocess on the default model)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenloom.entrypoints.cli import (
    build_parser,
    chat_session,
    read_requests,
    sampling_params_from_args,
)
from tokenloom.sampling_params import SamplingParams

from .fake_engine import FakeAsyncLLM
from .server_utils import REPO_ROOT

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
def test_generate_jsonl_file(tmp_path: Path) -> None:
    source = tmp_path / "prompts.jsonl"
    records = [
        {"id": 1, "prompt": "One, two,"},
        {"id": 2, "messages": [{"role": "user", "content": "Say hello."}]},
    ]
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    target = tmp_path / "results.jsonl"
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
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in target.read_text().splitlines()]
    assert [line["id"] for line in lines] == [1, 2]
    for line in lines:
        assert line["text"] and line["outputs"][0]["num_tokens"] <= 3
        assert line["num_prompt_tokens"] > 0
    assert "messages" in lines[1] and "prompt" in lines[0]


@pytest.mark.timeout(60)
def test_generate_needs_exactly_one_source() -> None:
    result = run_cli("generate")
    assert result.returncode == 2
    assert "PROMPT or --input" in result.stderr


async def test_chat_session_keeps_history_and_streams() -> None:
    engine = FakeAsyncLLM()
    turns = iter(["hi", "", "again", "/exit", "never read"])

    async def read_line() -> str:
        return next(turns)

    out = io.StringIO()
    history = await chat_session(engine, SamplingParams(max_tokens=2), "be brief", read_line, out)
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user", "assistant"]
    assert history[2]["content"] == "ab"
    assert out.getvalue() == "ab\nab\n"
    # The second turn's prompt carried the whole conversation so far.
    assert len(engine.prompts) == 2
    assert "user: hi\nassistant: ab\nuser: again\n" in engine.tokenizer.decode(engine.prompts[1])
    assert engine.finished == engine.started


async def test_chat_session_ends_on_eof_and_survives_a_refused_turn() -> None:
    engine = FakeAsyncLLM()
    turns = iter(["x" * 100, "ok"])

    async def read_line() -> str:
        try:
            return next(turns)
        except StopIteration:
            raise EOFError from None

    history = await chat_session(
        engine, SamplingParams(max_tokens=1), None, read_line, io.StringIO()
    )
    # The over-long first turn was refused (context 64) and left out of the history.
    assert history == [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "a"}]
