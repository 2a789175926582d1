"""``tokenloom serve --tensor-parallel-size 2`` over HTTP with the official
``openai`` client: the same greedy text as the offline engine at TP=1, and no
worker left behind when the server stops."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.entrypoints.server_utils import RemoteServer
from tokenloom.engine.llm import LLM
from tokenloom.sampling_params import SamplingParams

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Three colours of the rainbow are"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("tp_server") / "server.log"
    args = ["--tensor-parallel-size", "2", "--dtype", "float32", "--max-model-len", "512"]
    args += ["--num-blocks", "64", "--max-num-seqs", "4"]
    server = RemoteServer(args, log)
    yield server
    server.stop()


def _workers(server: RemoteServer) -> list[psutil.Process]:
    return [
        p
        for p in server.engine_core_processes()
        if "tokenloom.executor.worker_proc" in " ".join(p.cmdline())
    ]


def test_greedy_completions_match_tp1_and_workers_stop_with_the_server(
    server: RemoteServer, default_model_path: Path
) -> None:
    llm = LLM(str(default_model_path), dtype="float32", num_blocks=64, log_stats=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.client.shutdown()
    with server.openai_client(timeout=120) as client:
        for prompt, text in zip(PROMPTS, expected, strict=True):
            result = client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert result.choices[0].text == text
            stream = client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            assert "".join(chunk.choices[0].text for chunk in stream) == text
        # A structured request: its grammar bitmask travels to the workers with the step.
        choices = ["Lisbon", "Madrid", "Rome"]
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the capital of Spain?"}],
            max_tokens=8,
            temperature=0,
            extra_body={"structured_outputs": {"choice": choices}},
        )
        assert chat.choices[0].message.content in choices

    workers = _workers(server)
    assert len(workers) == 2
    server.stop()
    _, alive = psutil.wait_procs(workers, timeout=20)
    assert alive == []
