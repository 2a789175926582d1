"""``tokenloom disagg-proxy`` in front of two real server apps on model-free fake engines:
what each engine is asked, ``kv_transfer_params`` over HTTP both ways, streaming, and
the failures (a dead, slow, failing or refusing prefill engine; a dead decode engine)
that fall back to a local prefill or fail clearly, never hang."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tokenloom.entrypoints.cli import build_parser
from tokenloom.entrypoints.disagg_proxy import ProxyArgs
from tokenloom.entrypoints.disagg_proxy import build_app as build_proxy
from tokenloom.entrypoints.openai.server import build_app

from .fake_engine import FakeAsyncLLM

PARAMS = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1, "n": 7}


class Engines:
    def __init__(self) -> None:
        self.prefill = FakeAsyncLLM()
        self.prefill.kv_transfer_params = PARAMS
        self.decode = FakeAsyncLLM()


@pytest.fixture
def engines() -> Engines:
    return Engines()


def proxy_client(
    engines: Engines, prefill: httpx.AsyncBaseTransport | None = None, **args: Any
) -> httpx.AsyncClient:
    """A client of the proxy, whose own client reaches the engines' apps in process."""
    mounts = {
        "http://prefill": prefill or httpx.ASGITransport(app=build_app(engines.prefill)),
        "http://decode": httpx.ASGITransport(app=build_app(engines.decode)),
    }
    upstream = httpx.AsyncClient(mounts=mounts)
    proxy = build_proxy(
        ProxyArgs(**{"prefill": "http://prefill", "decode": "http://decode", **args}), upstream
    )
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy")


@pytest.fixture
async def client(engines: Engines) -> AsyncIterator[httpx.AsyncClient]:
    async with proxy_client(engines) as c:
        yield c


def extra(engine: FakeAsyncLLM) -> list[dict[str, Any] | None]:
    return [p.extra_args for p in engine.params]


async def test_prefill_then_decode_with_the_returned_params(
    engines: Engines, client: httpx.AsyncClient
) -> None:
    r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == "abcde"  # the decode engine's answer
    assert "kv_transfer_params" not in body  # the decode engine returned none
    # The prefill engine: one token, asked to keep the KV for a remote decode; its
    # HTTP answer carried the connector's params to the proxy.
    assert [p.max_tokens for p in engines.prefill.params] == [1]
    assert extra(engines.prefill) == [{"kv_transfer_params": {"do_remote_decode": True}}]
    # The decode engine: the whole request, with those params.
    assert [p.max_tokens for p in engines.decode.params] == [5]
    assert extra(engines.decode) == [{"kv_transfer_params": PARAMS}]
    assert engines.decode.prompts == engines.prefill.prompts


async def test_a_streamed_chat_passes_through(engines: Engines, client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True},
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    blocks = r.text.strip().split("\n\n")
    assert blocks[-1] == "data: [DONE]"
    text = "".join(
        choice["delta"].get("content") or ""
        for block in blocks[:-1]
        for choice in json.loads(block[len("data: ") :])["choices"]
    )
    assert text == "abc"
    assert extra(engines.prefill) == [{"kv_transfer_params": {"do_remote_decode": True}}]
    assert extra(engines.decode) == [{"kv_transfer_params": PARAMS}]


async def test_a_client_cannot_inject_kv_transfer_params(
    engines: Engines, client: httpx.AsyncClient
) -> None:
    body = {"prompt": "abc", "max_tokens": 2, "kv_transfer_params": {"remote_port": 9}}
    assert (await client.post("/v1/completions", json=body)).status_code == 200
    assert extra(engines.decode) == [{"kv_transfer_params": PARAMS}]


class Failing(httpx.AsyncBaseTransport):
    def __init__(self, status: int | None) -> None:
        self.status = status

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.status is None:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(self.status, json={"error": {"message": "no"}})


@pytest.mark.parametrize("status", [None, 500, 503])
async def test_a_dead_or_failing_prefill_engine_means_a_local_prefill(
    engines: Engines, status: int | None
) -> None:
    async with proxy_client(engines, prefill=Failing(status)) as c:
        r = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"
    assert extra(engines.decode) == [None]  # no kv_transfer_params: it prefills itself


async def test_a_prefill_engine_without_a_connector_means_a_local_prefill(
    engines: Engines, client: httpx.AsyncClient
) -> None:
    engines.prefill.kv_transfer_params = None
    r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    assert r.status_code == 200
    assert extra(engines.decode) == [None]


async def test_a_slow_prefill_engine_times_out_into_a_local_prefill(engines: Engines) -> None:
    # A real socket that accepts connections and never answers.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        mounts = {
            "http://decode": httpx.ASGITransport(app=build_app(engines.decode)),
        }
        upstream = httpx.AsyncClient(mounts=mounts)
        args = ProxyArgs(
            prefill=f"http://127.0.0.1:{port}", decode="http://decode", prefill_timeout=0.3
        )
        transport = httpx.ASGITransport(app=build_proxy(args, upstream))
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
            started = time.monotonic()
            r = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
            assert time.monotonic() - started < 5
    assert r.status_code == 200
    assert extra(engines.decode) == [None]


async def test_a_request_the_prefill_engine_refuses_is_answered_by_it(
    engines: Engines, client: httpx.AsyncClient
) -> None:
    r = await client.post("/v1/completions", json={"prompt": "x" * 100, "max_tokens": 2})
    assert r.status_code == 400
    assert r.json()["error"]["message"]
    assert engines.decode.params == []


async def test_a_dead_decode_engine_is_a_502_naming_it(engines: Engines) -> None:
    upstream = httpx.AsyncClient(
        mounts={
            "http://prefill": httpx.ASGITransport(app=build_app(engines.prefill)),
            "http://decode": Failing(None),
        }
    )
    args = ProxyArgs(prefill="http://prefill", decode="http://decode")
    transport = httpx.ASGITransport(app=build_proxy(args, upstream))
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
        r = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        health = await c.get("/health")
    assert r.status_code == 502
    assert "decode engine http://decode/v1/completions failed" in r.json()["error"]["message"]
    assert health.status_code == 503 and health.json()["prefill"] == "ok"


async def test_a_body_that_is_not_json_is_a_400(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", content=b"{")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_cli_flags_and_their_checks() -> None:
    args = build_parser().parse_args(
        ["disagg-proxy", "--prefill", "http://a:1/", "--decode", "http://b:2", "--port", "0"]
    )
    assert (args.prefill, args.decode, args.port) == ("http://a:1/", "http://b:2", 0)
    assert ProxyArgs(prefill="http://a:1/", decode="http://b:2").prefill == "http://a:1"
    with pytest.raises(ValueError, match="decode must be an http"):
        ProxyArgs(prefill="http://a:1", decode="b:2")
    with pytest.raises(ValueError, match="prefill_timeout"):
        ProxyArgs(prefill="http://a:1", decode="http://b:2", prefill_timeout=0)
