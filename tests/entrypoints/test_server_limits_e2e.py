"""A second, deliberately tight server: the waiting-queue limit, then engine death.

Kept apart from test_server_e2e so that killing the engine cannot disturb
other tests; the death test runs last in this module.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest

from .server_utils import RemoteServer, metric_values, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MODEL = "SmolLM2-135M-Instruct"
LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True}
SHORT = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("limited") / "server.log"
    args = ["--max-model-len", "256", "--num-blocks", "64", "--max-num-seqs", "1"]
    args += ["--max-engine-restarts", "0"]  # the engine's death is final here
    server = RemoteServer([*args, "--max-waiting-requests", "1"], log)
    yield server
    server.stop()


async def _first_event(lines: AsyncIterator[str]) -> str:
    """The first SSE event. The caller keeps ``lines`` alive: a line iterator that
    is garbage collected closes the response, which is a client disconnect."""
    while True:
        line = await lines.__anext__()
        if line.startswith("data: "):
            return line


async def test_waiting_limit_answers_503(limited: RemoteServer) -> None:
    async with httpx.AsyncClient(base_url=limited.url, timeout=120) as client:
        async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as first:
            assert first.status_code == 200
            lines = first.aiter_lines()
            await _first_event(lines)  # running: it holds the only slot
            queued = asyncio.create_task(client.post("/v1/completions", json=SHORT))
            # The gauge moves on the next engine step, which is slow on a busy machine.
            deadline = time.monotonic() + 120
            while (await asyncio.to_thread(metric_values, limited.url))[
                "tokenloom:num_requests_waiting{}"
            ] < 1:
                assert time.monotonic() < deadline, "second request never queued"
                await asyncio.sleep(0.2)
            rejected = await client.post("/v1/completions", json=SHORT)
            assert rejected.status_code == 503, rejected.text
            assert rejected.json()["error"]["code"] == 503
        # Closing the first stream frees the slot; the queued request completes.
        done = await asyncio.wait_for(queued, 120)
        assert done.status_code == 200, done.text
        assert done.json()["usage"]["completion_tokens"] == 2
    after = await asyncio.to_thread(
        httpx.post, limited.url + "/v1/completions", json=SHORT, timeout=120
    )
    assert after.status_code == 200


def test_engine_death_fails_requests_and_health(limited: RemoteServer) -> None:
    with limited.openai_client(timeout=60) as client:
        stream = client.completions.create(
            model=MODEL,
            prompt=LONG["prompt"],
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        assert next(chunks).choices[0].text is not None
        cores = limited.engine_core_processes()
        assert cores, "no engine core process found"
        for process in cores:
            process.kill()
        started = time.monotonic()
        with pytest.raises(openai.APIError):
            for _ in chunks:
                pass
        assert time.monotonic() - started < 30
    wait_until(
        lambda: httpx.get(limited.url + "/health", timeout=10).status_code >= 500,
        30,
        "/health to report the dead engine",
    )
    r = httpx.post(limited.url + "/v1/completions", json=SHORT, timeout=30)
    assert r.status_code >= 500
    assert r.json()["error"]["message"]
