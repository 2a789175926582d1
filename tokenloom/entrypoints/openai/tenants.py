"""Tenants: who sent a request (from its API key), their weight and their limits.

``--tenants FILE`` (JSON or YAML) lists them::

    tenants:
      - name: team-a
        api_keys: [sk-team-a-1, sk-team-a-2]
        weight: 3                      # share of the engine under --policy fair
        max_concurrent_requests: 16    # requests in flight at once
        max_waiting_requests: 4        # admitted requests with no output yet
        tokens_per_minute: 200000      # prompt + generated tokens

Requests with the ``--api-key`` key, and every request of a server that asks
for no key, belong to the tenant ``default`` (weight 1, no limits), which the
file may configure by naming it. Every other tenant needs at least one key.

A request over one of its tenant's limits is answered 429 with
``Retry-After`` at once, never queued. The limits count HTTP requests (a
completion with several prompts or ``n`` > 1 is one): in flight from
admission until the response is sent, waiting until the first output.
Tokens are counted as they are processed, in a bucket that refills at
``tokens_per_minute / 60`` per second up to ``tokens_per_minute``; a request
is admitted while the bucket is not empty, so one request may overdraw it and
the next ones wait for the refill.

Each HTTP request gets a ``TenantLease`` (set by the auth middleware in
``auth.py`` as ``current_lease``); the serving code admits it
(``OpenAIServing.check_capacity``), reports outputs to it, and the middleware
releases it when the response is over, however it ended.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tokenloom.metrics.prometheus import TenantMetrics
from tokenloom.options import OptionError, option, validate

from .errors import OpenAIError

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class TenantConfig:
    """One tenant of the tenants file."""

    name: str = option(
        DEFAULT_TENANT,
        pattern=r"[A-Za-z0-9_.:@-]{1,64}",
        requirement="1 to 64 letters, digits or _.:@-",
        help="the tenant's name (its metrics label)",
    )
    api_keys: list[str] | None = option(None, help="the keys its requests authenticate with")
    weight: float = option(1.0, gt=0, le=1e6, help="its share of the engine under the fair policy")
    max_concurrent_requests: int | None = option(None, ge=1, help="requests in flight at once")
    max_waiting_requests: int | None = option(
        None, ge=1, help="admitted requests that have not produced output yet"
    )
    tokens_per_minute: int | None = option(
        None, ge=1, help="prompt and generated tokens per minute"
    )

    def __post_init__(self) -> None:
        validate(self)
        for i, key in enumerate(self.api_keys or ()):
            if not key or key != key.strip():
                raise OptionError(
                    f"api_keys[{i}]", "a non-empty string without surrounding spaces", key
                )


def parse_tenants(data: object) -> list[TenantConfig]:
    """Tenants from a parsed tenants file (``{"tenants": [...]}`` or the list itself);
    errors name the entry and the field (``tenants[1].weight must be ...``)."""
    if isinstance(data, Mapping):
        unknown = sorted(str(k) for k in data if k != "tenants")
        if unknown:
            raise ValueError(f"{unknown[0]} is not a key of a tenants file (only: tenants)")
        data = data.get("tenants")
    if not isinstance(data, list) or not data:
        raise ValueError("tenants must be a non-empty list of tenants")
    known = {f.name for f in fields(TenantConfig)}
    tenants: list[TenantConfig] = []
    owners: dict[str, str] = {}
    for i, entry in enumerate(data):
        where = f"tenants[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where} must be a mapping, got {entry!r}")
        unknown = sorted(str(k) for k in entry if k not in known)
        if unknown:
            raise ValueError(
                f"{where}.{unknown[0]} is not a tenant field (fields: {', '.join(sorted(known))})"
            )
        if "name" not in entry:
            raise ValueError(f"{where}.name is required")
        try:
            tenant = TenantConfig(**entry)
        except OptionError as exc:
            raise ValueError(f"{where}.{exc}") from None
        if any(t.name == tenant.name for t in tenants):
            raise ValueError(f"{where}.name {tenant.name!r} names another tenant too")
        if not tenant.api_keys and tenant.name != DEFAULT_TENANT:
            raise ValueError(f"{where}.api_keys must list at least one key")
        for key in tenant.api_keys or ():
            if key in owners:
                raise ValueError(f"{where}.api_keys: a key of tenant {owners[key]!r} is reused")
            owners[key] = tenant.name
        tenants.append(tenant)
    return tenants


def load_tenants_file(path: str | Path) -> list[TenantConfig]:
    """Read and check a tenants file: JSON (``.json``) or YAML (anything else)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"tenants file {path}: {exc.strerror or exc}") from None
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except (ValueError, ImportError) as exc:
        raise ValueError(f"tenants file {path} does not parse: {exc}") from None
    except Exception as exc:  # yaml.YAMLError
        raise ValueError(f"tenants file {path} does not parse: {exc}") from None
    try:
        return parse_tenants(data)
    except ValueError as exc:
        raise ValueError(f"tenants file {path}: {exc}") from None


class TenantLimitError(OpenAIError):
    """429: the tenant is over a limit; ``retry_after_s`` says when to try again."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, status=429, headers={"Retry-After": str(retry_after_s)})
        self.retry_after_s = retry_after_s


class Tenant:
    """A tenant's limits and what it uses of them now. Event-loop only (no locks)."""

    def __init__(
        self,
        config: TenantConfig,
        metrics: TenantMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.name = config.name
        self.weight = config.weight
        self._metrics = metrics
        self._clock = clock
        self.in_flight = 0
        self.waiting = 0
        tpm = config.tokens_per_minute
        self._bucket = float(tpm) if tpm is not None else math.inf
        self._refilled_at = clock()
        if metrics is not None:
            metrics.expose(self.name)

    def _label(self) -> tuple[str, str]:
        assert self._metrics is not None
        return self._metrics.model_name, self.name

    def tokens_left(self) -> float:
        """The token bucket now (negative: overdrawn; inf: no token limit)."""
        tpm = self.config.tokens_per_minute
        if tpm is not None:
            now = self._clock()
            self._bucket = min(float(tpm), self._bucket + (now - self._refilled_at) * tpm / 60)
            self._refilled_at = now
        return self._bucket

    def admit(self) -> None:
        """Count one more request in flight, or raise TenantLimitError (429)."""
        config = self.config
        refusal: tuple[str, str, int] | None = None
        if (
            config.max_concurrent_requests is not None
            and self.in_flight >= config.max_concurrent_requests
        ):
            refusal = (
                "concurrent_requests",
                f"{config.max_concurrent_requests} concurrent requests",
                1,
            )
        elif (
            config.max_waiting_requests is not None and self.waiting >= config.max_waiting_requests
        ):
            refusal = ("waiting_requests", f"{config.max_waiting_requests} waiting requests", 1)
        elif config.tokens_per_minute is not None and self.tokens_left() <= 0:
            per_second = config.tokens_per_minute / 60
            # Whole seconds after which the bucket holds a token again.
            wait = math.floor(-self._bucket / per_second) + 1
            refusal = ("tokens_per_minute", f"{config.tokens_per_minute} tokens per minute", wait)
        if refusal is not None:
            reason, limit, retry_after = refusal
            if self._metrics is not None:
                self._metrics.rejected.labels(*self._label(), reason).inc()
            raise TenantLimitError(
                f"tenant {self.name!r} is over its limit of {limit}; retry after {retry_after} s",
                retry_after,
            )
        self.in_flight += 1
        self.waiting += 1
        if self._metrics is not None:
            self._metrics.requests.labels(*self._label()).inc()
            self._metrics.waiting.labels(*self._label()).inc()

    def started(self, seconds_to_first_output: float) -> None:
        self.waiting -= 1
        if self._metrics is not None:
            label = self._label()
            self._metrics.waiting.labels(*label).dec()
            self._metrics.running.labels(*label).inc()
            self._metrics.time_to_first_token.labels(*label).observe(seconds_to_first_output)

    def finished(self, started: bool) -> None:
        self.in_flight -= 1
        if not started:
            self.waiting -= 1
        if self._metrics is not None:
            (self._metrics.running if started else self._metrics.waiting).labels(
                *self._label()
            ).dec()

    def charge(self, prompt_tokens: int, generated_tokens: int) -> None:
        if self.config.tokens_per_minute is not None:
            self.tokens_left()
            self._bucket -= prompt_tokens + generated_tokens
        if self._metrics is not None:
            label = self._label()
            if prompt_tokens:
                self._metrics.prompt_tokens.labels(*label).inc(prompt_tokens)
            if generated_tokens:
                self._metrics.generation_tokens.labels(*label).inc(generated_tokens)


@dataclass
class TenantLease:
    """One HTTP request's hold on its tenant: admitted at most once, released once."""

    tenant: Tenant
    admitted: bool = False
    started: bool = False
    released: bool = False
    admitted_at: float = field(default=0.0)

    def admit(self) -> None:
        """Take a place within the tenant's limits (429 if there is none); idempotent."""
        if self.admitted or self.released:
            return
        self.tenant.admit()
        self.admitted = True
        self.admitted_at = time.monotonic()

    def on_output(self, prompt_tokens: int, generated_tokens: int) -> None:
        """An engine output for this request: the first one ends its wait."""
        if not self.admitted or self.released:
            return
        if not self.started:
            self.started = True
            self.tenant.started(time.monotonic() - self.admitted_at)
        self.tenant.charge(prompt_tokens, generated_tokens)

    def release(self) -> None:
        if self.admitted and not self.released:
            self.tenant.finished(self.started)
        self.released = True


# The lease of the HTTP request being handled (set by the auth middleware).
current_lease: ContextVar[TenantLease | None] = ContextVar("tokenloom_tenant_lease", default=None)


class TenantRegistry:
    """The server's tenants by name, always including ``default``."""

    def __init__(
        self, configs: Iterable[TenantConfig] = (), metrics: TenantMetrics | None = None
    ) -> None:
        self.by_name: dict[str, Tenant] = {}
        for config in configs:
            self.by_name[config.name] = Tenant(config, metrics)
        if DEFAULT_TENANT not in self.by_name:
            self.by_name[DEFAULT_TENANT] = Tenant(TenantConfig(), metrics)
        self.default = self.by_name[DEFAULT_TENANT]

    def __getitem__(self, name: str) -> Tenant:
        return self.by_name[name]

    def has_limits(self) -> bool:
        return any(_has_limits(t.config) for t in self.by_name.values())


def _has_limits(config: TenantConfig) -> bool:
    return any(
        value is not None
        for value in (
            config.max_concurrent_requests,
            config.max_waiting_requests,
            config.tokens_per_minute,
        )
    )


def describe(configs: Iterable[TenantConfig]) -> dict[str, Any]:
    """A log-safe summary (no keys): name -> weight and limits."""
    return {
        c.name: {
            "weight": c.weight,
            "keys": len(c.api_keys or ()),
            **{
                k: v
                for k, v in (
                    ("max_concurrent_requests", c.max_concurrent_requests),
                    ("max_waiting_requests", c.max_waiting_requests),
                    ("tokens_per_minute", c.tokens_per_minute),
                )
                if v is not None
            },
        }
        for c in configs
    }
