"""API keys, tenants and their limits, CORS and the root path, on the fake engine.

The same behaviour through the real server, the official client and TLS is
in test_multi_tenancy_e2e.py; here each rule is checked in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenloom.entrypoints.openai.auth import AccessConfig, ApiKeys, CorsConfig, route_path
from tokenloom.entrypoints.openai.cli_args import ServerArgs, add_serve_args
from tokenloom.entrypoints.openai.server import build_app
from tokenloom.entrypoints.openai.tenants import (
    TenantConfig,
    load_tenants_file,
    parse_tenants,
)
from tokenloom.pooling.config import PoolerConfig

from .fake_engine import FakeAsyncLLM

COMPLETION = {"prompt": "hi", "max_tokens": 3}
TENANTS = (
    TenantConfig(name="alice", api_keys=["sk-alice"], weight=3.0),
    TenantConfig(name="bob", api_keys=["sk-bob-1", "sk-bob-2"], max_concurrent_requests=1),
    TenantConfig(name="carol", api_keys=["sk-carol"], max_waiting_requests=1),
    TenantConfig(name="dave", api_keys=["sk-dave"], tokens_per_minute=6),
)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def engine() -> FakeAsyncLLM:
    return FakeAsyncLLM()


def client_for(app: Any, root_path: str = "") -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, root_path=root_path)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


@pytest.fixture
async def client(engine: FakeAsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    access = AccessConfig(api_key="sk-admin", tenants=TENANTS)
    async with client_for(build_app(engine, access=access)) as c:
        yield c


async def metrics(client: httpx.AsyncClient, **headers: str) -> dict[str, float]:
    text = (await client.get("/metrics", headers=headers)).text
    return {
        f"{s.name}{{{s.labels.get('tenant', '')},{s.labels.get('reason', '')}}}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if family.name.startswith("tokenloom:tenant")
    }


# ---------------------------------------------------------------------- keys


async def test_generation_needs_a_known_key(client: httpx.AsyncClient) -> None:
    for headers in ({}, auth("sk-wrong"), {"Authorization": "sk-alice"}, auth("")):
        r = await client.post("/v1/completions", json=COMPLETION, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        error = r.json()["error"]
        assert error["code"] == 401 and error["type"] == "AuthenticationError"
    for route in ("/v1/models", "/v1/chat/completions", "/v1/anything-added-later"):
        r = await client.request("POST" if "chat" in route else "GET", route)
        assert r.status_code == 401, route
    for key in ("sk-admin", "sk-alice", "sk-bob-2", "sk-carol", "sk-dave"):
        r = await client.post("/v1/completions", json=COMPLETION, headers=auth(key))
        assert r.status_code == 200, (key, r.text)
    # The scheme is case-insensitive, as RFC 9110 says.
    r = await client.get("/v1/models", headers={"Authorization": "bearer sk-alice"})
    assert r.status_code == 200


async def test_open_routes_stay_open(client: httpx.AsyncClient) -> None:
    for route in ("/health", "/version", "/metrics", "/openapi.json", "/docs"):
        assert (await client.get(route)).status_code == 200, route


async def test_dashboard_page_is_open_and_its_data_needs_a_key(
    client: httpx.AsyncClient,
) -> None:
    for route in ("/dashboard", "/dashboard/static/dashboard.js"):
        assert (await client.get(route)).status_code == 200, route
    assert (await client.get("/dashboard/state")).status_code == 401
    assert (await client.get("/dashboard/static/../state")).status_code == 401
    r = await client.get("/dashboard/state", headers=auth("sk-alice"))
    assert r.status_code == 200 and "running" in r.text


async def test_protect_metrics_puts_metrics_behind_the_key(engine: FakeAsyncLLM) -> None:
    app = build_app(engine, access=AccessConfig(api_key="sk-admin", protect_metrics=True))
    async with client_for(app) as c:
        assert (await c.get("/metrics")).status_code == 401
        assert (await c.get("/metrics", headers=auth("sk-admin"))).status_code == 200
        assert (await c.get("/health")).status_code == 200


async def test_no_key_configured_means_no_key_needed(engine: FakeAsyncLLM) -> None:
    async with client_for(build_app(engine)) as c:
        assert (await c.post("/v1/completions", json=COMPLETION)).status_code == 200
        assert (await c.get("/v1/models", headers=auth("anything"))).status_code == 200
    assert engine.tenants == [("default", 1.0)]


def test_keys_are_found_by_digest_whatever_their_length() -> None:
    keys = ApiKeys([("sk-a", "A"), ("sk-" + "b" * 300, "B"), ("ключ", "C")])
    assert keys.tenant_of("sk-a") == "A"
    assert keys.tenant_of("sk-" + "b" * 300) == "B"
    assert keys.tenant_of("ключ") == "C"
    for wrong in ("sk-", "sk-a ", "SK-A", "sk-" + "b" * 299, "", "\udc80"):
        assert keys.tenant_of(wrong) is None


def test_api_key_must_not_be_a_tenants_key() -> None:
    with pytest.raises(ValueError, match="api_key is also a key of tenant 'alice'"):
        AccessConfig(api_key="sk-alice", tenants=TENANTS)


# ---------------------------------------------------------------------- tenants


async def test_each_request_runs_as_its_keys_tenant(
    client: httpx.AsyncClient, engine: FakeAsyncLLM
) -> None:
    for key in ("sk-alice", "sk-bob-1", "sk-admin"):
        r = await client.post("/v1/completions", json=COMPLETION, headers=auth(key))
        assert r.status_code == 200
    r = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        headers=auth("sk-alice"),
    )
    assert r.status_code == 200
    assert engine.tenants == [("alice", 3.0), ("bob", 1.0), ("default", 1.0), ("alice", 3.0)]
    seen = await metrics(client)
    assert seen["tokenloom:tenant_requests_total{alice,}"] == 2
    assert seen["tokenloom:tenant_generation_tokens_total{alice,}"] == 5
    assert seen["tokenloom:tenant_prompt_tokens_total{bob,}"] == 2
    assert seen["tokenloom:tenant_time_to_first_token_seconds_count{default,}"] == 1
    # Nothing in flight any more.
    gauges = ("tokenloom:tenant_requests_running{", "tokenloom:tenant_requests_waiting{")
    assert all(value == 0 for name, value in seen.items() if name.startswith(gauges))


async def test_embeddings_run_as_the_keys_tenant() -> None:
    engine = FakeAsyncLLM(pooler_config=PoolerConfig(pooling_type="LAST", hidden_size=4))
    app = build_app(engine, access=AccessConfig(api_key="sk-admin", tenants=TENANTS))
    async with client_for(app) as c:
        for key, text in (("sk-alice", "abcd"), ("sk-admin", "xy")):
            body = {"input": text, "model": "fake-model"}
            r = await c.post("/v1/embeddings", json=body, headers=auth(key))
            assert r.status_code == 200, r.text
        seen = await metrics(c)
    # The engine schedules each under its key's tenant and weight.
    assert engine.tenants == [("alice", 3.0), ("default", 1.0)]
    assert seen["tokenloom:tenant_requests_total{alice,}"] == 1
    assert seen["tokenloom:tenant_prompt_tokens_total{alice,}"] == 4
    assert seen["tokenloom:tenant_prompt_tokens_total{default,}"] == 2


async def _refused(client: httpx.AsyncClient, key: str, reason: str) -> httpx.Response:
    r = await client.post("/v1/completions", json=COMPLETION, headers=auth(key))
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    error = r.json()["error"]
    assert error["type"] == "RateLimitError" and error["code"] == 429
    assert reason.replace("_", " ") in error["message"]
    return r


async def test_concurrency_limit(client: httpx.AsyncClient, engine: FakeAsyncLLM) -> None:
    engine.hold = asyncio.Event()
    first = asyncio.create_task(
        client.post("/v1/completions", json=COMPLETION, headers=auth("sk-bob-1"))
    )
    while engine.started.count("cmpl") == 0 and not engine.started:
        await asyncio.sleep(0.01)
    # Any of the tenant's keys counts against the same limit; other tenants are not held.
    await _refused(client, "sk-bob-2", "concurrent_requests")
    engine.hold.set()
    assert (await first).status_code == 200
    r = await client.post("/v1/completions", json=COMPLETION, headers=auth("sk-bob-2"))
    assert r.status_code == 200
    seen = await metrics(client)
    assert seen["tokenloom:tenant_requests_rejected_total{bob,concurrent_requests}"] == 1


async def test_waiting_limit_counts_requests_without_output(
    client: httpx.AsyncClient, engine: FakeAsyncLLM
) -> None:
    engine.hold = asyncio.Event()
    queued = asyncio.create_task(
        client.post(
            "/v1/completions", json={**COMPLETION, "stream": True}, headers=auth("sk-carol")
        )
    )
    while not engine.started:
        await asyncio.sleep(0.01)
    await _refused(client, "sk-carol", "waiting_requests")
    # Another tenant is not affected.
    other = asyncio.create_task(
        client.post("/v1/completions", json=COMPLETION, headers=auth("sk-alice"))
    )
    await asyncio.sleep(0.05)
    engine.hold.set()
    assert (await queued).status_code == 200 and (await other).status_code == 200
    # Once its request produced output, the tenant may queue another.
    r = await client.post("/v1/completions", json=COMPLETION, headers=auth("sk-carol"))
    assert r.status_code == 200


async def test_tokens_per_minute_refills(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenloom.entrypoints.openai import tenants as tenants_module

    now = [1000.0]
    monkeypatch.setattr(tenants_module.time, "monotonic", lambda: now[0])
    app_tenants = client._transport.app.state.tenants  # type: ignore[attr-defined]
    dave = app_tenants["dave"]
    dave._clock = lambda: now[0]
    dave._refilled_at = now[0]
    # 2 prompt + 3 generated tokens of 6 per minute: admitted, 1 left.
    assert (
        await client.post("/v1/completions", json=COMPLETION, headers=auth("sk-dave"))
    ).status_code == 200
    # 1 left: admitted, and it overdraws the bucket to -4.
    assert (
        await client.post("/v1/completions", json=COMPLETION, headers=auth("sk-dave"))
    ).status_code == 200
    r = await _refused(client, "sk-dave", "tokens_per_minute")
    assert r.headers["retry-after"] == "41"  # 4 tokens at 6 per minute, then one more
    now[0] += 40
    await _refused(client, "sk-dave", "tokens_per_minute")  # empty, not yet positive
    now[0] += 1
    assert (
        await client.post("/v1/completions", json=COMPLETION, headers=auth("sk-dave"))
    ).status_code == 200


# ---------------------------------------------------------------------- the file


def test_tenants_file_json_and_yaml(tmp_path: Path) -> None:
    entries = [
        {"name": "a", "api_keys": ["k1"], "weight": 2, "tokens_per_minute": 1000},
        {"name": "default", "max_concurrent_requests": 4},
    ]
    (tmp_path / "t.json").write_text(json.dumps({"tenants": entries}))
    (tmp_path / "t.yaml").write_text(
        "tenants:\n"
        "  - name: a\n    api_keys: [k1]\n    weight: 2\n    tokens_per_minute: 1000\n"
        "  - name: default\n    max_concurrent_requests: 4\n"
    )
    for name in ("t.json", "t.yaml"):
        tenants = load_tenants_file(tmp_path / name)
        assert [(t.name, t.weight, t.api_keys) for t in tenants] == [
            ("a", 2, ["k1"]),
            ("default", 1.0, None),
        ]
        assert tenants[0].tokens_per_minute == 1000
        assert tenants[1].max_concurrent_requests == 4


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"tenants": []}, "tenants must be a non-empty list"),
        ({"tenant": []}, "tenant is not a key of a tenants file"),
        ([{"api_keys": ["k"]}], r"tenants\[0\].name is required"),
        ([{"name": "a b", "api_keys": ["k"]}], r"tenants\[0\].name must be 1 to 64"),
        ([{"name": "a", "api_keys": ["k"], "weight": 0}], r"tenants\[0\].weight must be"),
        ([{"name": "a", "api_keys": ["k"], "weight": "3"}], r"tenants\[0\].weight must be"),
        ([{"name": "a"}], r"tenants\[0\].api_keys must list at least one key"),
        ([{"name": "a", "api_keys": "k"}], r"tenants\[0\].api_keys must be"),
        ([{"name": "a", "api_keys": [" k"]}], r"tenants\[0\].api_keys\[0\] must be"),
        ([{"name": "a", "api_keys": ["k"], "rpm": 3}], r"tenants\[0\].rpm is not a tenant field"),
        (
            [{"name": "a", "api_keys": ["k"], "max_waiting_requests": 0}],
            r"tenants\[0\].max_waiting_requests must be",
        ),
        (
            [{"name": "a", "api_keys": ["k"]}, {"name": "a", "api_keys": ["j"]}],
            r"tenants\[1\].name 'a' names another tenant",
        ),
        (
            [{"name": "a", "api_keys": ["k"]}, {"name": "b", "api_keys": ["k"]}],
            r"tenants\[1\].api_keys: a key of tenant 'a' is reused",
        ),
        ([3], r"tenants\[0\] must be a mapping"),
    ],
)
def test_tenants_file_errors_name_the_field(data: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_tenants(data)


def test_unreadable_tenants_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tenants file .*missing.yaml"):
        load_tenants_file(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("tenants: [\n")
    with pytest.raises(ValueError, match="does not parse"):
        load_tenants_file(tmp_path / "bad.yaml")


# ---------------------------------------------------------------------- flags


def server_args(*argv: str) -> ServerArgs:
    parser = add_serve_args(argparse.ArgumentParser())
    return ServerArgs.from_cli_args(parser.parse_args(list(argv)))


def test_api_key_flag_and_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TOKENLOOM_API_KEY", raising=False)
    assert not server_args().access_config().requires_key
    monkeypatch.setenv("TOKENLOOM_API_KEY", "sk-env")
    assert server_args().access_config().api_key == "sk-env"
    assert server_args("--api-key", "sk-flag").access_config().api_key == "sk-flag"
    path = tmp_path / "t.yaml"
    path.write_text("- name: a\n  api_keys: [k]\n")
    access = server_args("--tenants", str(path), "--protect-metrics").access_config()
    assert [t.name for t in access.tenants] == ["a"] and access.protect_metrics
    assert not access.is_open("/metrics") and access.is_open("/health")


def test_tls_and_cors_and_root_path_flags(tmp_path: Path) -> None:
    key = tmp_path / "key.pem"
    key.write_text("x")
    with pytest.raises(ValueError, match="ssl_keyfile and ssl_certfile go together"):
        server_args("--ssl-keyfile", str(key))
    with pytest.raises(ValueError, match="ssl_certfile '.*nope.pem' is not a file"):
        server_args("--ssl-keyfile", str(key), "--ssl-certfile", str(tmp_path / "nope.pem"))
    assert server_args().cors_config() is None
    cors = server_args("--allowed-origins", '["https://a.example"]').cors_config()
    assert cors == CorsConfig(("https://a.example",))
    cors = server_args(
        "--allowed-origins", "https://a.example, https://b.example", "--allowed-methods", "POST"
    ).cors_config()
    assert cors is not None and cors.allowed_origins == ("https://a.example", "https://b.example")
    assert cors.allowed_methods == ("POST",)
    with pytest.raises(ValueError, match="allowed_origins is not a valid JSON list"):
        server_args("--allowed-origins", "[nope")
    with pytest.raises(ValueError, match="root_path must be a path starting with /"):
        server_args("--root-path", "llm/")
    assert server_args("--root-path", "/llm").root_path == "/llm"


# ---------------------------------------------------------------------- CORS, root path


async def test_cors_preflight_allowed_and_refused(engine: FakeAsyncLLM) -> None:
    preflight: Callable[[str], dict[str, str]] = lambda origin: {  # noqa: E731
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    cors = CorsConfig(("https://app.example",))
    app = build_app(engine, access=AccessConfig(api_key="sk"), cors=cors)
    async with client_for(app) as c:
        ok = await c.options("/v1/completions", headers=preflight("https://app.example"))
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "https://app.example"
        refused = await c.options("/v1/completions", headers=preflight("https://evil.example"))
        assert refused.status_code == 400
        assert "access-control-allow-origin" not in refused.headers
        # A 401 still carries the CORS header, so the page can read why.
        r = await c.post(
            "/v1/completions", json=COMPLETION, headers={"Origin": "https://app.example"}
        )
        assert r.status_code == 401
        assert r.headers["access-control-allow-origin"] == "https://app.example"
    # By default no origin is allowed: no CORS headers at all.
    async with client_for(build_app(engine, access=AccessConfig(api_key="sk"))) as c:
        r = await c.options("/v1/completions", headers=preflight("https://app.example"))
        assert "access-control-allow-origin" not in r.headers


async def test_root_path_behind_a_proxy(engine: FakeAsyncLLM) -> None:
    app = build_app(engine, access=AccessConfig(api_key="sk"))
    async with client_for(app, root_path="/llm") as c:  # as uvicorn --root-path /llm
        # A proxy that keeps the prefix, and one that strips it.
        for prefix in ("/llm", ""):
            assert (await c.get(prefix + "/health")).status_code == 200
            assert (await c.get(prefix + "/v1/models")).status_code == 401
            r = await c.get(prefix + "/v1/models", headers=auth("sk"))
            assert r.status_code == 200, prefix
        # Only a whole path segment is a prefix.
        assert (await c.get("/llmx/health")).status_code in (401, 404)
    assert route_path({"path": "/llm/health", "root_path": "/llm"}) == "/health"
    assert route_path({"path": "/llm", "root_path": "/llm"}) == ""


async def test_openapi_declares_the_key_and_the_429(client: httpx.AsyncClient) -> None:
    schema = (await client.get("/openapi.json")).json()
    assert schema["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    completions = schema["paths"]["/v1/completions"]["post"]
    assert completions["security"] == [{"bearerAuth": []}]
    assert {"401", "429"} <= set(completions["responses"])
    assert "security" not in schema["paths"]["/health"]["get"]
