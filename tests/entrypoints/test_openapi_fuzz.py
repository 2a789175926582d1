"""Schemathesis against the published /openapi.json of the app on the fake engine.

Requests are generated from the schema (valid ones, and invalid ones that
break it) and sent in process. No answer may be a 5xx, and every answer must
be one the schema declares, with a body that matches it; server-sent events
are checked one by one against the chunk schemas.
"""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis import checks as st_checks

from tokenloom.entrypoints.openai.auth import AccessConfig
from tokenloom.entrypoints.openai.server import build_app
from tokenloom.entrypoints.openai.tenants import TenantConfig
from tokenloom.pooling.config import PoolerConfig

from .fake_engine import FakeAsyncLLM

CHECKS = [
    st_checks.not_a_server_error,
    st_checks.status_code_conformance,
    st_checks.content_type_conformance,
    st_checks.response_schema_conformance,
    st_checks.response_headers_conformance,
]
MIN_REQUESTS = 500
# Examples per POST operation and mode; GET operations take no input, so one each.
EXAMPLES = {GenerationMode.POSITIVE: 200, GenerationMode.NEGATIVE: 100}


def _exercise(
    operation: schemathesis.APIOperation,
    mode: GenerationMode,
    count: int,
    statuses: Counter[tuple[str, int]],
    headers: dict[str, str] | None = None,
) -> None:
    """Send ``count`` generated requests to ``operation`` (with ``headers``); each answer
    must match the schema (CHECKS), and its status is counted in ``statuses``."""

    @settings(
        max_examples=count,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        response = case.call(headers=headers)
        statuses[(operation.label, response.status_code)] += 1
        case.validate_response(response, checks=CHECKS)

    run()


@pytest.mark.timeout(120)
def test_generated_requests_get_declared_answers_and_no_5xx() -> None:
    engine = FakeAsyncLLM()
    schema = schemathesis.openapi.from_asgi("/openapi.json", build_app(engine))
    statuses: Counter[tuple[str, int]] = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.method.upper() == "GET":
            _exercise(operation, GenerationMode.POSITIVE, 1, statuses)
            continue
        for mode, count in EXAMPLES.items():
            _exercise(operation, mode, count, statuses)

    total = sum(statuses.values())
    assert total >= MIN_REQUESTS, statuses
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        # Both the answering path and the rejection path were exercised.
        assert statuses[(f"POST {path}", 200)] > 20, statuses
        assert statuses[(f"POST {path}", 400)] > 20, statuses
    assert not any(status >= 500 for _, status in statuses)
    # Every engine request that started was closed again (none leaked).
    assert engine.num_running_requests == 0
    assert sorted(engine.closed) == sorted(engine.started)


@pytest.mark.timeout(180)
def test_with_api_keys_and_tenant_limits_every_answer_is_declared() -> None:
    """The same checks on an app that requires a key and has a rate-limited tenant:
    with the tenant's key (generation and its 429s), with the admin key, and without."""
    engine = FakeAsyncLLM()
    tenant = TenantConfig(name="t", api_keys=["sk-t"], weight=2.0, tokens_per_minute=400)
    access = AccessConfig(api_key="sk-admin", tenants=(tenant,))
    schema = schemathesis.openapi.from_asgi("/openapi.json", build_app(engine, access=access))
    statuses: Counter[tuple[str, int]] = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        for key in ("sk-t", "sk-admin", None):
            headers = {"Authorization": f"Bearer {key}"} if key else None
            count = 1 if operation.method.upper() == "GET" else 40 if key else 10
            _exercise(operation, GenerationMode.POSITIVE, count, statuses, headers)
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert statuses[(f"POST {path}", 200)] > 10, statuses
        assert statuses[(f"POST {path}", 401)] >= 10, statuses
    # The tenant's 400 tokens a minute run out; the admin (default tenant) has no limit.
    assert sum(n for (_, status), n in statuses.items() if status == 429) > 0, statuses
    assert statuses[("GET /health", 200)] == 3
    assert not any(status >= 500 for _, status in statuses)
    assert engine.num_running_requests == 0
    assert {tenant for tenant, _ in engine.tenants} == {"t", "default"}


@pytest.mark.timeout(120)
def test_lora_endpoints_get_declared_answers_and_no_5xx() -> None:
    """The same checks on the LoRA endpoints of an app started with enable_lora."""
    engine = FakeAsyncLLM()
    schema = schemathesis.openapi.from_asgi("/openapi.json", build_app(engine, enable_lora=True))
    statuses: Counter[tuple[str, int]] = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        if "lora" not in operation.path:
            continue
        for mode, count in ((GenerationMode.POSITIVE, 60), (GenerationMode.NEGATIVE, 30)):
            _exercise(operation, mode, count, statuses)
    assert statuses[("POST /v1/load_lora_adapter", 400)] > 10, statuses
    assert statuses[("POST /v1/unload_lora_adapter", 404)] > 10, statuses
    assert not any(status >= 500 for _, status in statuses)


@pytest.mark.timeout(120)
def test_embeddings_endpoint_gets_declared_answers_and_no_5xx() -> None:
    """The same checks on /v1/embeddings of an app over a pooling engine."""
    pooler = PoolerConfig(pooling_type="LAST", normalize=True, hidden_size=4, is_matryoshka=True)
    engine = FakeAsyncLLM(pooler_config=pooler)
    schema = schemathesis.openapi.from_asgi("/openapi.json", build_app(engine))
    statuses: Counter[tuple[str, int]] = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path != "/v1/embeddings":
            continue
        for mode, count in EXAMPLES.items():
            _exercise(operation, mode, count, statuses)
    assert statuses[("POST /v1/embeddings", 200)] > 20, statuses
    assert statuses[("POST /v1/embeddings", 400)] > 20, statuses
    assert not any(status >= 500 for _, status in statuses)
    assert sorted(engine.closed) == sorted(engine.started)
