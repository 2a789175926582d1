"""Crash recovery through the real server: SIGKILL the engine core while streams
run over HTTP (the official openai client). /health says degraded while the core
restarts and is healthy after; every stream ends with exactly the text of a run
without the crash; the restart is counted in /metrics."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from .server_utils import RemoteServer, metric_values, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
NUM_STREAMS = 6
MAX_TOKENS = 24


def request(i: int) -> dict[str, Any]:
    """Even streams greedy, odd ones seeded sampling."""
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": f"Tell a short story about lighthouse number {i}.",
        "max_tokens": MAX_TOKENS,
        "extra_body": {"ignore_eos": True},
    }
    if i % 2:
        body.update(temperature=0.9, seed=77 + i)
    else:
        body["temperature"] = 0.0
    return body


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("crash") / "server.log"
    args = ["--dtype", "float32", "--max-model-len", "512", "--num-blocks", "256"]
    server = RemoteServer(
        [*args, "--max-engine-restarts", "2", "--engine-restart-backoff-s", "0.2"], log
    )
    yield server
    server.stop()


def health(url: str) -> tuple[int, str]:
    try:
        r = httpx.get(url + "/health", timeout=5)
    except httpx.TransportError:
        return 0, ""
    return r.status_code, r.text


def test_sigkill_while_streaming_over_http(server: RemoteServer) -> None:
    client = server.openai_client(timeout=600)
    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        reference = list(
            pool.map(
                lambda i: client.completions.create(**request(i)).choices[0].text,
                range(NUM_STREAMS),
            )
        )
    assert len(set(reference)) > 1

    received = [0] * NUM_STREAMS

    def stream(i: int) -> str:
        text = []
        for chunk in client.completions.create(**request(i), stream=True):
            choice = chunk.choices[0]
            text.append(choice.text)
            received[i] += 1
        assert choice.finish_reason == "length"
        return "".join(text)

    seen: list[tuple[int, str]] = []
    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        futures = [pool.submit(stream, i) for i in range(NUM_STREAMS)]
        wait_until(lambda: min(received) >= 3, 300, "every stream's first chunks")
        cores = server.engine_core_processes()
        assert cores, "no engine core process found"
        for process in cores:
            process.kill()
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                seen.append(health(server.url))
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            texts = [f.result(timeout=600) for f in futures]
        finally:
            stop.set()
            watcher.join()

    assert (200, '{"status":"degraded"}') in seen, f"never degraded: {set(seen)}"
    assert all(code == 200 for code, _ in seen), f"unhealthy during the restart: {set(seen)}"
    assert health(server.url) == (200, "")
    for i in range(NUM_STREAMS):
        assert texts[i] == reference[i], f"stream {i} differs after the crash"
    restarts = metric_values(server.url)["tokenloom:engine_restarts_total{}"]
    assert restarts == 1
