"""API keys, tenants and their limits, TLS and CORS through the real server.

One server (the default model, ``--policy fair``, one sequence at a time so
that a second request has to wait) speaks TLS with a certificate made here,
requires ``--api-key`` or a tenant's key, and allows one browser origin. The
official ``openai`` client talks to it, retries off, so every 401 and 429
is seen as it was sent.
"""

from __future__ import annotations

import datetime
import ipaddress
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from .server_utils import RemoteServer, metric_values, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MODEL = "SmolLM2-135M-Instruct"
ADMIN = "sk-admin-e2e"
KEYS = {"alice": "sk-alice-e2e", "bob": "sk-bob-e2e", "carol": "sk-carol-e2e"}
TENANTS_YAML = f"""
tenants:
  - name: alice
    api_keys: [{KEYS["alice"]}]
    weight: 2
    tokens_per_minute: 180
  - name: bob
    api_keys: [{KEYS["bob"]}]
    max_concurrent_requests: 1
  - name: carol
    api_keys: [{KEYS["carol"]}]
    max_waiting_requests: 1
"""
ORIGIN = "https://app.example"


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tokenloom test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    directory = tmp_path_factory.mktemp("tenancy")
    cert, key = make_certificate(directory)
    tenants = directory / "tenants.yaml"
    tenants.write_text(TENANTS_YAML)
    args = ["--max-model-len", "256", "--num-blocks", "64", "--max-num-seqs", "1"]
    args += ["--policy", "fair", "--api-key", ADMIN, "--tenants", str(tenants)]
    args += ["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
    args += ["--allowed-origins", f'["{ORIGIN}"]']
    remote = RemoteServer(args, directory / "server.log", ca_file=cert)
    yield remote
    remote.stop()


def client(server: RemoteServer, key: str) -> openai.OpenAI:
    return server.openai_client(timeout=120, api_key=key, max_retries=0)


def complete(server: RemoteServer, key: str, **kwargs: Any) -> Any:
    with client(server, key) as c:
        return c.completions.create(
            model=MODEL,
            prompt=kwargs.pop("prompt", "Hello"),
            max_tokens=kwargs.pop("max_tokens", 2),
            extra_body={"ignore_eos": True},
            **kwargs,
        )


def tenant_metric(server: RemoteServer, name: str, tenant: str, **labels: str) -> float:
    extra = "".join(f",{k}={v}" for k, v in sorted(labels.items()))
    key = f"tokenloom:{name}{{{extra.lstrip(',')}{',' if extra else ''}tenant={tenant}}}"
    return metric_values(server.url, server.verify).get(key, -1.0)


def test_a_key_is_required(server: RemoteServer) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        complete(server, "sk-wrong")
    assert caught.value.status_code == 401
    assert caught.value.response.json()["error"]["code"] == 401
    # The official client always sends a key: without one, as a plain HTTP client.
    for route in ("/v1/models", "/v1/completions"):
        r = httpx.request(
            "GET" if route == "/v1/models" else "POST",
            server.url + route,
            json={"model": MODEL, "prompt": "Hello"},
            verify=server.verify,
        )
        assert r.status_code == 401, route
        assert r.json()["error"]["type"] == "AuthenticationError"
    # Health checks and scrapers need no key.
    assert httpx.get(server.url + "/health", verify=server.verify).status_code == 200
    assert httpx.get(server.url + "/metrics", verify=server.verify).status_code == 200


def test_each_tenants_key_is_served_as_that_tenant(server: RemoteServer) -> None:
    for tenant, key in [("default", ADMIN), *KEYS.items()]:
        before = tenant_metric(server, "tenant_requests_total", tenant)
        result = complete(server, key)
        assert result.usage is not None and result.usage.completion_tokens == 2
        assert tenant_metric(server, "tenant_requests_total", tenant) == before + 1
        assert tenant_metric(server, "tenant_generation_tokens_total", tenant) >= 2


def test_tls_is_real(server: RemoteServer) -> None:
    assert server.url.startswith("https://")
    # Without trusting the test's certificate the handshake fails.
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(server.url + "/health")
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url.replace("https://", "http://") + "/health", timeout=10)


def _rate_limited(server: RemoteServer, key: str, what: str) -> int:
    with pytest.raises(openai.RateLimitError) as caught:
        complete(server, key)
    response = caught.value.response
    assert response.status_code == 429
    assert what in response.json()["error"]["message"]
    retry_after = int(response.headers["retry-after"])
    assert retry_after >= 1
    return retry_after


def _running_stream(c: openai.OpenAI) -> Any:
    """A long streamed completion, returned once its first chunk came (it is running)."""
    stream = c.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=200,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for _ in stream:
        break
    return stream


def _send_until_waiting(
    server: RemoteServer, tenant: str, results: dict[str, Any]
) -> threading.Thread:
    """Send a completion with ``tenant``'s key in a thread (its result lands in
    ``results[tenant]``); return once the server counts it as waiting."""
    thread = threading.Thread(
        target=lambda: results.setdefault(tenant, complete(server, KEYS[tenant]))
    )
    thread.start()
    wait_until(
        lambda: tenant_metric(server, "tenant_requests_waiting", tenant) == 1,
        60,
        f"{tenant}'s request to wait",
    )
    return thread


def test_over_the_concurrency_limit(server: RemoteServer) -> None:
    with client(server, KEYS["bob"]) as c:
        stream = _running_stream(c)  # bob's one request
        _rate_limited(server, KEYS["bob"], "concurrent requests")
        # Other tenants are not held back by bob's limit: carol's request is
        # accepted (it waits for the one sequence slot until bob's stream closes).
        results: dict[str, Any] = {}
        other = _send_until_waiting(server, "carol", results)
        stream.close()
    other.join(timeout=120)
    assert results["carol"].usage.completion_tokens == 2
    # Closing the stream gives bob's place back: the next request is served.
    wait_until(
        lambda: tenant_metric(server, "tenant_requests_running", "bob") == 0, 60, "bob's release"
    )
    assert complete(server, KEYS["bob"]).usage is not None
    assert (
        tenant_metric(server, "tenant_requests_rejected_total", "bob", reason="concurrent_requests")
        == 1
    )


def test_over_the_waiting_limit(server: RemoteServer) -> None:
    results: dict[str, Any] = {}
    with client(server, ADMIN) as c:
        stream = _running_stream(c)  # the default tenant holds the only sequence slot
        queued = _send_until_waiting(server, "carol", results)
        _rate_limited(server, KEYS["carol"], "waiting requests")
        stream.close()
    queued.join(timeout=120)
    assert results["carol"].usage.completion_tokens == 2  # it waited, and was served


def test_over_the_tokens_per_minute(server: RemoteServer) -> None:
    # 180 tokens a minute: this request alone (a 230-token prompt, computed in one
    # step, and one output) overdraws it by about 50, whatever the machine's speed.
    prompt = [1000 + i for i in range(230)]
    assert complete(server, KEYS["alice"], prompt=prompt, max_tokens=1).usage is not None
    started = time.monotonic()
    retry_after = _rate_limited(server, KEYS["alice"], "tokens per minute")
    assert time.monotonic() - started < 10  # refused at once, not queued
    # The overdraft (at most the 231 tokens less the 180 of a full bucket) refills
    # at 3 tokens a second.
    assert retry_after <= 20, retry_after
    # Retry-After is honest: after it, alice is served again.
    time.sleep(retry_after)
    assert complete(server, KEYS["alice"], max_tokens=1).usage is not None


def test_cors_preflight_allowed_and_refused(server: RemoteServer) -> None:
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(
            server.url + "/v1/chat/completions",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
            verify=server.verify,
        )

    allowed = preflight(ORIGIN)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in allowed.headers["access-control-allow-methods"]
    refused = preflight("https://elsewhere.example")
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers
