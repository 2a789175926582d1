"""/v1/embeddings against the model-free fake engine: the response shape (float and
base64), usage, a 400 naming the field for every bad input, and the route's
absence (404) on an engine that generates."""

from __future__ import annotations

import array
import base64
import math
from typing import Any

import httpx
import pytest

from tokenloom.entrypoints.openai.server import build_app
from tokenloom.pooling.config import PoolerConfig

from .fake_engine import FakeAsyncLLM
from .test_app_fake_engine import assert_error

POOLER = PoolerConfig(pooling_type="LAST", normalize=True, hidden_size=4, is_matryoshka=True)


@pytest.fixture
def engine() -> FakeAsyncLLM:
    """A pooling engine (the conftest's ``client`` serves the app over it)."""
    return FakeAsyncLLM(pooler_config=POOLER)


def _fake_vector(ids: list[int], dims: int = 4, normalize: bool = True) -> list[float]:
    vector = [float(len(ids)), float(sum(ids) % 97), 1.0, 2.0][:dims]
    norm = math.sqrt(sum(v * v for v in vector)) if normalize else 1.0
    return [float(array.array("f", [v / norm])[0]) for v in vector]


async def test_one_text_gives_one_embedding_and_usage(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/embeddings", json={"input": "abc", "model": "fake-model"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("embd-") and body["object"] == "list"
    assert body["model"] == "fake-model" and isinstance(body["created"], int)
    assert body["data"] == [
        {"index": 0, "object": "embedding", "embedding": _fake_vector([97, 98, 99])}
    ]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (["ab", "c"], [[97, 98], [99]]),
        ([5, 6, 7], [[5, 6, 7]]),
        ([[5], [6, 7]], [[5], [6, 7]]),
    ],
)
async def test_input_shapes(
    client: httpx.AsyncClient, engine: FakeAsyncLLM, value: Any, expected: list[list[int]]
) -> None:
    r = await client.post("/v1/embeddings", json={"input": value})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(len(expected)))
    assert [d["embedding"] for d in data] == [_fake_vector(ids) for ids in expected]
    assert engine.prompts == expected
    assert r.json()["usage"]["prompt_tokens"] == sum(map(len, expected))


async def test_base64_carries_the_float32_bytes(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/embeddings", json={"input": ["ab", "c"], "encoding_format": "base64"}
    )
    assert r.status_code == 200, r.text
    for item, ids in zip(r.json()["data"], [[97, 98], [99]], strict=True):
        values = array.array("f", base64.b64decode(item["embedding"])).tolist()
        assert values == _fake_vector(ids)


async def test_dimensions_normalize_and_truncation_reach_the_engine(
    client: httpx.AsyncClient, engine: FakeAsyncLLM
) -> None:
    r = await client.post(
        "/v1/embeddings",
        json={"input": "abcdef", "dimensions": 2, "normalize": False, "truncate_prompt_tokens": 3},
    )
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["embedding"] == _fake_vector([100, 101, 102], 2, normalize=False)
    (params,) = engine.pooling_params
    assert (params.dimensions, params.normalize, params.truncate_prompt_tokens) == (2, False, 3)
    assert engine.prompts == [[100, 101, 102]]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": [-1]}, "input"),
        ({"input": [1.5]}, "input"),
        ({"input": "x" * 65}, "input"),
        ({"input": ["a"] * 2049}, "input"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "dimensions": 5}, "dimensions"),
        ({"input": "a", "dimensions": "two"}, "dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"input": "a", "truncate_prompt_tokens": 65}, "truncate_prompt_tokens"),
        ({"input": "a", "normalize": "maybe"}, "normalize"),
        ({"input": "a", "model": "other"}, "model"),
        ({"input": "a", "user": 3}, "user"),
        ({"input": "a", "priority": "high"}, "priority"),
    ],
)
async def test_bad_requests_get_a_400_naming_the_field(
    client: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    r = await client.post("/v1/embeddings", json=body)
    assert_error(r, 400, param)


async def test_dimensions_on_a_model_without_matryoshka(engine: FakeAsyncLLM) -> None:
    engine.pooler_config = PoolerConfig(pooling_type="LAST", normalize=True, hidden_size=4)
    transport = httpx.ASGITransport(app=build_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        r = await client.post("/v1/embeddings", json={"input": "a", "dimensions": 2})
    error = assert_error(r, 400, "dimensions")
    assert "does not support Matryoshka" in error["message"]


async def test_a_generating_engine_has_no_embeddings_route() -> None:
    transport = httpx.ASGITransport(app=build_app(FakeAsyncLLM()))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        r = await client.post("/v1/embeddings", json={"input": "a"})
        assert_error(r, 404, None)
        schema = (await client.get("/openapi.json")).json()
    assert "/v1/embeddings" not in schema["paths"]


async def test_the_schema_publishes_the_route(client: httpx.AsyncClient) -> None:
    schema = (await client.get("/openapi.json")).json()
    operation = schema["paths"]["/v1/embeddings"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/EmbeddingRequest"
    }
    assert "EmbeddingResponse" in schema["components"]["schemas"]
