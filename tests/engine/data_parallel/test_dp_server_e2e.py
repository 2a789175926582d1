"""Data parallel serving over HTTP: two engine cores (local processes, or Ray actors on a
local Ray instance) behind one server, driven by the official ``openai`` client."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.entrypoints.server_utils import RemoteServer, metric_values

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = (
    "You are a terse assistant for a hardware store. You answer in one short sentence, "
    "never use lists, and always name the aisle where the item can be found. "
)
QUESTIONS = ["Where are the hammers?", "Where is the paint?", "Where are the screws?"]


@pytest.fixture(scope="module", params=["mp", "ray"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    backend = request.param
    log = tmp_path_factory.mktemp(f"dp-{backend}") / "server.log"
    args = ["-dp", "2", "--data-parallel-backend", backend, "--max-model-len", "512"]
    args += ["--num-blocks", "128", "--max-num-seqs", "8"]
    server = RemoteServer(args, log)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> Iterator[openai.OpenAI]:
    with server.openai_client(timeout=300) as c:
        yield c


def ask(client: openai.OpenAI, question: str) -> str:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=12,
        temperature=0,
    )
    return reply.choices[0].message.content or ""


def per_engine(values: dict[str, float], name: str) -> dict[str, float]:
    """``engine label -> summed value`` of one metric."""
    totals: dict[str, float] = {}
    for key, value in values.items():
        if key.startswith(name + "{") and "engine=" in key:
            engine = key.split("engine=")[1].split(",")[0].rstrip("}")
            totals[engine] = totals.get(engine, 0.0) + value
    return totals


def test_openai_client_is_served_by_both_cores(server: RemoteServer, client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert completion.choices[0].text and completion.usage is not None
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a fruit."}],
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    # Concurrent greedy requests: the same question gets the same answer, whichever core.
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda q: ask(client, q), QUESTIONS * 2))
    assert answers[:3] == answers[3:] and all(answers)
    finished = per_engine(metric_values(server.url), "tokenloom:request_success_total")
    assert set(finished) == {"0", "1"}
    assert all(count > 0 for count in finished.values()), finished


def test_repeated_prompts_stay_on_the_core_that_caches_them(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    before = metric_values(server.url)
    for _ in range(3):
        ask(client, "Where are the ladders? " * 8)
    after = metric_values(server.url)
    hits = per_engine(after, "tokenloom:prefix_cache_hits_total")
    queries = per_engine(after, "tokenloom:prefix_cache_queries_total")
    old_hits = per_engine(before, "tokenloom:prefix_cache_hits_total")
    old_queries = per_engine(before, "tokenloom:prefix_cache_queries_total")
    new_hits = {e: hits[e] - old_hits.get(e, 0.0) for e in hits}
    new_queries = {e: queries[e] - old_queries.get(e, 0.0) for e in queries}
    # All three went to one core (the other saw no query), and two of them hit its cache.
    busy = [e for e, q in new_queries.items() if q > 0]
    assert len(busy) == 1, new_queries
    prompt_tokens = new_queries[busy[0]] / 3
    assert new_hits[busy[0]] >= 2 * (prompt_tokens - 16), (new_hits, new_queries)
