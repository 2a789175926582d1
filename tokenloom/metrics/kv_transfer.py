"""KV connector stats -> Prometheus (``KVTransferStats``; see docs/kv_connectors.md).

vLLM's names where vLLM has them (``external_prefix_cache_queries`` and
``_hits``: tokens looked up in, and loaded from, a connector's store); the
rest name what a disk tier or a transfer between engines does: bytes and
seconds per op (``load``/``save`` for the disk tier, ``recv``/``send``
between engines), failures by reason, and the disk tier's size.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenloom.outputs import KVTransferStats

_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class KVTransferMetrics:
    """The KV connector's series, labelled like the other engine metrics (``labels``)."""

    def __init__(self, prefix: str, labels: list[str], registry: CollectorRegistry) -> None:
        reg = registry
        self.queries = Counter(
            prefix + "external_prefix_cache_queries",
            "Prompt tokens of requests that looked the KV connector's store up.",
            labels,
            registry=reg,
        )
        self.hits = Counter(
            prefix + "external_prefix_cache_hits",
            "Prompt tokens loaded from the KV connector's store instead of computed.",
            labels,
            registry=reg,
        )
        self.recomputed = Counter(
            prefix + "kv_transfer_recomputed_tokens",
            "Tokens whose KV failed to load and was computed instead.",
            labels,
            registry=reg,
        )
        self.bytes = Counter(
            prefix + "kv_transfer_bytes",
            "KV bytes moved by the KV connector, by op (load, save, recv, send).",
            [*labels, "op"],
            registry=reg,
        )
        self.seconds = Histogram(
            prefix + "kv_transfer_seconds",
            "Time of one KV transfer (a request's load or receive, a step's saves, a send).",
            [*labels, "op"],
            buckets=_SECONDS_BUCKETS,
            registry=reg,
        )
        self.errors = Counter(
            prefix + "kv_transfer_errors",
            "KV connector failures by reason (corrupt, truncated, foreign, disk_full, "
            "peer_unreachable, timeout, ...); each means recomputed KV, never wrong KV.",
            [*labels, "reason"],
            registry=reg,
        )
        self.tier_bytes = Gauge(
            prefix + "kv_offload_disk_bytes",
            "Bytes the disk KV tier holds (or is writing).",
            labels,
            registry=reg,
        )

    def record(self, stats: KVTransferStats, name: tuple[str, ...]) -> None:
        self.queries.labels(*name).inc(stats.num_queried_tokens)
        self.hits.labels(*name).inc(stats.num_hit_tokens)
        self.recomputed.labels(*name).inc(stats.num_recomputed_tokens)
        for op, count in stats.num_bytes.items():
            self.bytes.labels(*name, op).inc(count)
        for op, values in stats.seconds.items():
            histogram = self.seconds.labels(*name, op)
            for seconds in values:
                histogram.observe(seconds)
        for reason, count in stats.errors.items():
            self.errors.labels(*name, reason).inc(count)
        if stats.tier_bytes is not None:
            self.tier_bytes.labels(*name).set(stats.tier_bytes)
