"""LoRA in the HTTP layer (fake engine): load/unload endpoints, /v1/models,
selecting an adapter by ``model``, refusing to unload an adapter in use, and
the Open API document listing the endpoints."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tokenloom.entrypoints.openai.server import build_app, parse_lora_modules

from .fake_engine import FakeAsyncLLM


@pytest.fixture
def engine() -> FakeAsyncLLM:
    return FakeAsyncLLM(step_delay=0.01)


@pytest.fixture
async def client(engine: FakeAsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(engine, served_model_name="base", enable_lora=True)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


async def _models(client: httpx.AsyncClient) -> dict[str, dict]:
    body = (await client.get("/v1/models")).json()
    return {card["id"]: card for card in body["data"]}


async def test_load_select_unload(
    client: httpx.AsyncClient, engine: FakeAsyncLLM, tmp_path: Path
) -> None:
    r = await client.post(
        "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(tmp_path)}
    )
    assert r.status_code == 200 and "sql" in r.text
    models = await _models(client)
    assert set(models) == {"base", "sql"}
    assert models["sql"]["parent"] == "base" and models["sql"]["root"] == str(tmp_path)

    for model, expected in (("sql", "sql"), ("base", None), (None, None)):
        body = {"prompt": "hi", "max_tokens": 2, **({"model": model} if model else {})}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        lora = engine.loras[-1]
        assert (lora.lora_name if lora else None) == expected
    chat = {"model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
    assert engine.loras[-1] is not None and engine.loras[-1].lora_name == "sql"

    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert r.status_code == 200
    assert engine.removed_loras == [engine.added_loras[0].lora_int_id]  # weights dropped
    assert set(await _models(client)) == {"base"}
    r = await client.post("/v1/completions", json={"model": "sql", "prompt": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert r.status_code == 404

    # loaded again: a new id, so the old weights' cached blocks cannot be reused
    await client.post(
        "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(tmp_path)}
    )
    ids = [lora.lora_int_id for lora in engine.added_loras]
    assert len(ids) == 2 and ids[0] != ids[1]


async def test_bad_loads_are_refused(client: httpx.AsyncClient, tmp_path: Path) -> None:
    r = await client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nope"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "lora_path" and "/nope" in r.json()["error"]["message"]
    for name in ("base", "fake-model"):
        r = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(tmp_path)}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = await client.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400


async def test_unloading_an_adapter_in_use_is_refused(
    client: httpx.AsyncClient, engine: FakeAsyncLLM, tmp_path: Path
) -> None:
    await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path)})
    body = {"model": "a", "prompt": "hi", "max_tokens": 30}
    running = asyncio.create_task(client.post("/v1/completions", json=body))
    while not engine.started:  # the request is running (30 steps of 10 ms)
        await asyncio.sleep(0.005)
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert r.status_code == 400 and "in use by 1 request" in r.json()["error"]["message"]
    # other requests, with the adapter or without, run meanwhile
    other = await client.post(
        "/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 2}
    )
    assert other.status_code == 200
    assert not running.done()
    assert (await running).status_code == 200
    await asyncio.sleep(0)
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert r.status_code == 200


async def test_openapi_lists_lora_endpoints(client: httpx.AsyncClient) -> None:
    schema = (await client.get("/openapi.json")).json()
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(schema["paths"])
    model = schema["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
    assert model["anyOf"][0] == {"type": "string"}  # adapters come and go: any name
    assert "LoadLoRAAdapterRequest" in schema["components"]["schemas"]


async def test_without_lora_there_are_no_endpoints(engine: FakeAsyncLLM) -> None:
    app = build_app(engine)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
        assert r.status_code == 404


def test_lora_modules_flag() -> None:
    assert parse_lora_modules(["a=/x", "b=/y=z"]) == [("a", "/x"), ("b", "/y=z")]
    assert parse_lora_modules(None) == []
    with pytest.raises(SystemExit, match="name=path"):
        parse_lora_modules(["nopath"])
