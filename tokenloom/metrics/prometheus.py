"""Engine stats -> Prometheus metrics, under vLLM's metric names.

``PrometheusStatLogger`` implements the engine's ``StatLogger`` protocol:
the engine calls ``record`` after each step with a scheduler snapshot and the
step's iteration stats. Names mirror vLLM's (``vllm:num_requests_running`` is
``tokenloom:num_requests_running`` here) so existing dashboards carry over.
Each logger writes to the registry it is given, so several servers (or
tests) in one process do not collide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenloom.metrics.kv_transfer import KVTransferMetrics
from tokenloom.outputs import SchedulerStats

if TYPE_CHECKING:
    from tokenloom.metrics.stats import IterationStats

PREFIX = "tokenloom:"
FINISH_REASONS = ("stop", "length", "abort")

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0)
_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_REQUEST_TIME_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


def token_count_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to the first value >= ``max_value``."""
    buckets: list[float] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            buckets.append(float(step * scale))
            if step * scale >= max_value:
                return buckets
        scale *= 10


class PrometheusStatLogger:
    """Turns ``SchedulerStats`` and ``IterationStats`` into metrics labelled ``model_name``.

    With ``num_engines`` > 1 (data parallel) every series also carries an
    ``engine`` label, the index of the core the stats came from (as vLLM's).
    """

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        max_model_len: int = 32768,
        num_engines: int = 1,
    ) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self._per_engine = num_engines > 1
        labels = ["model_name", "engine"] if self._per_engine else ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=reg)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Requests waiting to be scheduled."
        )
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV cache usage, 1 means 100 percent.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the cache.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted by the scheduler.")
        self.engine_restarts = counter(
            "engine_restarts", "Engine core start attempts after a crash (crash recovery)."
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed (prefill).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter(
            "request_success", "Finished requests by finish reason.", ("finished_reason",)
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens.", _ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_TIME_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Time spent waiting before first scheduled.",
            _REQUEST_TIME_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", _REQUEST_TIME_BUCKETS
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "First token to last token.", _REQUEST_TIME_BUCKETS
        )
        self.structured_requests = counter(
            "structured_output_requests", "Requests with structured outputs (a grammar)."
        )
        self.grammar_compile_time = histogram(
            "structured_output_compile_time_seconds",
            "Time to compile one grammar (cache misses only).",
            _COMPILE_BUCKETS,
        )
        self.grammar_cache_hits = counter(
            "structured_output_grammar_cache_hits",
            "Structured requests that reused an already compiled (or compiling) grammar.",
        )
        count_buckets = token_count_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length of finished requests.", count_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens of finished requests.", count_buckets
        )
        # Speculative decoding (vLLM's names); per-position acceptance is labelled 0 .. k-1.
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Verifications of draft tokens (one per request and step)."
        )
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self.spec_decode_num_accepted_tokens_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each position of the drafts.",
            ("position",),
        )
        self.kv_transfer = KVTransferMetrics(PREFIX, labels, reg)
        # Expose every finish reason from the start so rate() works on the first request.
        for engine in range(num_engines):
            self._expose(self._label_values(engine))

    def _label_values(self, engine_index: int) -> tuple[str, ...]:
        if self._per_engine:
            return (self.model_name, str(engine_index))
        return (self.model_name,)

    def _expose(self, name: tuple[str, ...]) -> None:
        for reason in FINISH_REASONS:
            self.request_success.labels(*name, reason)
        for metric in (
            self.num_requests_running,
            self.num_requests_waiting,
            self.kv_cache_usage,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.num_preemptions,
            self.engine_restarts,
            self.prompt_tokens,
            self.generation_tokens,
            self.structured_requests,
            self.grammar_compile_time,
            self.grammar_cache_hits,
        ):
            metric.labels(*name)

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
    ) -> None:
        name = self._label_values(iteration_stats.engine_index if iteration_stats else 0)
        if scheduler_stats is not None:
            self.num_requests_running.labels(*name).set(scheduler_stats.num_running_reqs)
            self.num_requests_waiting.labels(*name).set(scheduler_stats.num_waiting_reqs)
            self.kv_cache_usage.labels(*name).set(scheduler_stats.kv_cache_usage)
            self.prefix_cache_queries.labels(*name).inc(scheduler_stats.prefix_cache_queries)
            self.prefix_cache_hits.labels(*name).inc(scheduler_stats.prefix_cache_hits)
            self.num_preemptions.labels(*name).inc(scheduler_stats.num_preemptions)
            spec = scheduler_stats.spec_decoding_stats
            if spec is not None:
                self.spec_decode_num_drafts.labels(*name).inc(spec.num_drafts)
                self.spec_decode_num_draft_tokens.labels(*name).inc(spec.num_draft_tokens)
                self.spec_decode_num_accepted_tokens.labels(*name).inc(spec.num_accepted_tokens)
                per_pos = self.spec_decode_num_accepted_tokens_per_pos
                for position, count in enumerate(spec.num_accepted_tokens_per_pos):
                    per_pos.labels(*name, str(position)).inc(count)
            if scheduler_stats.num_structured_requests:
                self.structured_requests.labels(*name).inc(scheduler_stats.num_structured_requests)
                self.grammar_cache_hits.labels(*name).inc(scheduler_stats.grammar_cache_hits)
            compile_time = self.grammar_compile_time.labels(*name)
            for seconds in scheduler_stats.grammar_compile_times:
                compile_time.observe(seconds)
            if scheduler_stats.kv_transfer_stats is not None:
                self.kv_transfer.record(scheduler_stats.kv_transfer_stats, name)
        if iteration_stats is None:
            return
        if iteration_stats.num_engine_restarts:
            self.engine_restarts.labels(*name).inc(iteration_stats.num_engine_restarts)
        self.prompt_tokens.labels(*name).inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.labels(*name).inc(iteration_stats.num_generation_tokens)
        ttft = self.time_to_first_token.labels(*name)
        for value in iteration_stats.time_to_first_tokens_iter:
            ttft.observe(value)
        itl = self.inter_token_latency.labels(*name)
        for value in iteration_stats.inter_token_latencies_iter:
            itl.observe(value)
        for finished in iteration_stats.finished_requests:
            self.request_success.labels(*name, str(finished.finish_reason)).inc()
            self.e2e_request_latency.labels(*name).observe(finished.e2e_latency)
            self.request_queue_time.labels(*name).observe(finished.queued_time)
            self.request_prefill_time.labels(*name).observe(finished.prefill_time)
            self.request_decode_time.labels(*name).observe(finished.decode_time)
            self.request_prompt_tokens.labels(*name).observe(finished.num_prompt_tokens)
            self.request_generation_tokens.labels(*name).observe(finished.num_generation_tokens)


class TenantMetrics:
    """The server's per-tenant metrics: every series carries a ``tenant`` label.

    The front end records them (it knows each request's tenant from its API
    key): requests admitted, refused over a limit (``reason``: the limit),
    running and waiting, tokens processed, and time to first token.
    """

    LIMITS = ("concurrent_requests", "waiting_requests", "tokens_per_minute")

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        labels = ["model_name", "tenant"]
        self.model_name = model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=registry)

        self.requests = counter("tenant_requests", "Requests admitted, per tenant.")
        self.rejected = counter(
            "tenant_requests_rejected",
            "Requests answered 429 because the tenant was over a limit.",
            ("reason",),
        )
        self.running = gauge(
            "tenant_requests_running", "Admitted requests that have produced output."
        )
        self.waiting = gauge(
            "tenant_requests_waiting", "Admitted requests that have not produced output yet."
        )
        self.prompt_tokens = counter("tenant_prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("tenant_generation_tokens", "Tokens generated.")
        self.time_to_first_token = Histogram(
            PREFIX + "tenant_time_to_first_token_seconds",
            "Admission to first output, per tenant.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )

    def expose(self, tenant: str) -> None:
        """Create a tenant's series at zero, so dashboards see it before its first request."""
        name = (self.model_name, tenant)
        for limit in self.LIMITS:
            self.rejected.labels(*name, limit)
        for metric in (
            self.requests,
            self.running,
            self.waiting,
            self.prompt_tokens,
            self.generation_tokens,
            self.time_to_first_token,
        ):
            metric.labels(*name)
