"""The serving front end imports no torch: AsyncLLM with its core in its own process,
the HTTP app, chat rendering, and a greedy generation, in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import asyncio, json, sys

import httpx

from tokenloom import SamplingParams
from tokenloom.engine.args import EngineArgs
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.protocol import ChatOptions
from tokenloom.entrypoints.openai.server import build_app

engine = AsyncLLM.from_engine_args(EngineArgs(num_blocks=64, max_model_len=256, log_stats=False))


async def main():
    app = build_app(engine)
    rendered = await engine.render_chat([{"role": "user", "content": "Hi"}], ChatOptions())
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outs = [o async for o in engine.generate(rendered.token_ids, params, "direct")]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        body = {"model": engine.model_name, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
        response = await client.post("/v1/completions", json=body)
        # Structured requests too: their constraints are checked by the grammar
        # backend (which imports torch) in a helper process, not here.
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        structured = await client.post(
            "/v1/completions", json={**body, "max_tokens": 12, "structured_outputs": {"json": schema}}
        )
        invalid = await client.post(
            "/v1/completions", json={**body, "structured_outputs": {"regex": "[a-z"}}
        )
    return rendered, outs[-1], response, structured, invalid


try:
    rendered, final, response, structured, invalid = asyncio.run(main())
finally:
    engine.shutdown()
print(json.dumps({
    "core_pid": engine.engine_core_pid,
    "chat": rendered.text,
    "tokens": final.outputs[0].token_ids,
    "status": response.status_code,
    "structured": [structured.status_code, invalid.status_code, invalid.json()["error"]["param"]],
    "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
}))
"""


def test_front_end_process_never_imports_torch(tmp_path: Path) -> None:
    # No tokenizer cache: the GGUF tokenizer is converted (a torch import) in a subprocess.
    env = dict(os.environ, TOKENLOOM_CACHE_DIR="", OMP_NUM_THREADS="2")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=540,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["core_pid"] and report["core_pid"] != os.getpid()
    assert report["chat"].endswith("<|im_start|>assistant\n")
    assert len(report["tokens"]) == 3
    assert report["status"] == 200, result.stderr[-4000:]
    assert report["structured"][:2] == [200, 400], result.stderr[-4000:]
    assert report["structured"][2].startswith("structured_outputs"), report["structured"]
    assert report["torch"] == [], f"the front end imported {report['torch'][:5]}"
