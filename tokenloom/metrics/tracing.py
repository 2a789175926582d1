"""Request traces: an OpenTelemetry span per finished request, exported over OTLP.

``RequestTracer`` is a stat logger: when a request finishes it emits vLLM's
``llm_request`` span (kind SERVER, from arrival to finish, continuing the
HTTP request's W3C trace context) with vLLM's attributes (``gen_ai.*``
usage, request parameters and latencies), the prefix-cache hit and the
preemptions, and three child spans for the request's phases: ``queue``
(arrival to first scheduled), ``prefill`` (to the first token) and
``decode`` (to the finish). Each preemption is an event on the request span.

OpenTelemetry is optional (``pip install tokenloom[otel]``); it is imported
only when tracing is switched on.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from tokenloom.metrics.stats import FinishedRequestStats, IterationStats
from tokenloom.outputs import SchedulerStats

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer


class SpanAttributes:
    """Attribute names: vLLM's (``vllm.tracing.SpanAttributes``), then tokenloom's."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    # The semantic conventions' name for prompt tokens served from a cache.
    GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
    GEN_AI_RESPONSE_FINISH_REASON = "gen_ai.response.finish_reason"
    NUM_PREEMPTIONS = "tokenloom.num_preemptions"


SPAN_NAME = "llm_request"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def span_exporter(endpoint: str) -> SpanExporter:
    """The OTLP exporter for ``endpoint``: http/protobuf (the OpenTelemetry default;
    a URL without a path gets the standard ``/v1/traces``) or, when
    ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc``, gRPC. ``ValueError`` saying what
    to install when the exporter is missing."""
    protocol = os.environ.get(PROTOCOL_ENV, "http/protobuf")
    try:
        import opentelemetry.sdk.trace  # noqa: F401

        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )

            return GrpcExporter(endpoint=endpoint)
        if protocol != "http/protobuf":
            raise ValueError(
                f"{PROTOCOL_ENV}={protocol!r} is not supported (http/protobuf or grpc)"
            )
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise ValueError(
            f"otlp_traces_endpoint needs the OpenTelemetry OTLP exporter ({exc.name} is "
            "missing): pip install tokenloom[otel]"
            + (" opentelemetry-exporter-otlp-proto-grpc" if protocol == "grpc" else "")
        ) from None
    if urlsplit(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return OTLPSpanExporter(endpoint=endpoint)


class RequestTracer:
    """Emits a span per finished request (see the module doc); a ``StatLogger``."""

    def __init__(self, model_name: str, provider: TracerProvider) -> None:
        self.model_name = model_name
        self.provider = provider
        self._tracer: Tracer = provider.get_tracer("tokenloom")

    @classmethod
    def to_endpoint(cls, model_name: str, endpoint: str) -> RequestTracer:
        """A tracer batching its spans to the OTLP collector at ``endpoint``."""
        exporter = span_exporter(endpoint)
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": "tokenloom"}))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(model_name, provider)

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        if iteration_stats is None:
            return
        for finished in iteration_stats.finished_requests:
            if finished.timeline is not None:
                self.trace(finished)

    def trace(self, finished: FinishedRequestStats) -> None:
        """The spans of one finished request."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        timeline = finished.timeline
        assert timeline is not None
        arrival = timeline.arrival_time
        end = timeline.finish_time if timeline.finish_time is not None else arrival
        scheduled = timeline.first_scheduled_time
        first_token = timeline.first_token_time
        attributes: dict[str, Any] = {
            SpanAttributes.GEN_AI_RESPONSE_MODEL: self.model_name,
            SpanAttributes.GEN_AI_REQUEST_ID: timeline.request_id,
            SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: timeline.num_prompt_tokens,
            SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS: timeline.num_generation_tokens,
            SpanAttributes.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: timeline.num_cached_tokens,
            SpanAttributes.GEN_AI_LATENCY_E2E: finished.e2e_latency,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE: finished.queued_time,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: finished.prefill_time,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: finished.decode_time,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: (
                finished.prefill_time + finished.decode_time
            ),
            SpanAttributes.NUM_PREEMPTIONS: len(timeline.preemption_times),
            SpanAttributes.GEN_AI_RESPONSE_FINISH_REASON: finished.finish_reason,
        }
        if first_token is not None:
            attributes[SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = first_token - arrival
        params = finished.sampling_params
        if params is not None:
            attributes[SpanAttributes.GEN_AI_REQUEST_TEMPERATURE] = params.temperature
            attributes[SpanAttributes.GEN_AI_REQUEST_TOP_P] = params.top_p
            attributes[SpanAttributes.GEN_AI_REQUEST_N] = params.n
            if params.max_tokens is not None:
                attributes[SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS] = params.max_tokens
        context = TraceContextTextMapPropagator().extract(dict(finished.trace_headers or {}))
        tracer = self._tracer
        span = tracer.start_span(
            SPAN_NAME,
            context=context,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=_ns(arrival),
        )
        for when in timeline.preemption_times:
            span.add_event("preempted", timestamp=_ns(when))
        inside = trace.set_span_in_context(span)
        phases = (("queue", arrival, scheduled), ("prefill", scheduled, first_token))
        for name, start, stop in (*phases, ("decode", first_token, end)):
            if start is None or stop is None:
                continue
            phase = tracer.start_span(name, context=inside, start_time=_ns(start))
            phase.end(end_time=_ns(max(stop, start)))
        span.end(end_time=_ns(end))

    def shutdown(self) -> None:
        """Export the spans still batched, then stop."""
        self.provider.shutdown()
