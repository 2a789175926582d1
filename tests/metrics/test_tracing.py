"""RequestTracer: one llm_request span per finished request, vLLM's attributes, phases."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tokenloom.metrics.stats import FinishedRequestStats, IterationStats, RequestTimeline
from tokenloom.metrics.tracing import RequestTracer, span_exporter
from tokenloom.sampling_params import SamplingParams

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def traced() -> tuple[RequestTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return RequestTracer("my-model", provider), exporter


def finished(headers: dict[str, str] | None) -> FinishedRequestStats:
    timeline = RequestTimeline(
        request_id="cmpl-1-0",
        arrival_time=100.0,
        first_scheduled_time=100.5,
        first_token_time=101.0,
        finish_time=103.0,
        preemption_times=[101.5, 102.0],
        num_prompt_tokens=40,
        num_generation_tokens=9,
        num_cached_tokens=32,
        finish_reason="length",
    )
    return FinishedRequestStats(
        "length",
        e2e_latency=3.0,
        queued_time=0.5,
        prefill_time=0.5,
        decode_time=2.0,
        num_prompt_tokens=40,
        num_generation_tokens=9,
        timeline=timeline,
        sampling_params=SamplingParams(max_tokens=9, temperature=0.5, top_p=0.9),
        trace_headers=headers,
    )


def test_a_finished_request_becomes_a_span_with_phases() -> None:
    tracer, exporter = traced()
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    tracer.record(None, IterationStats(finished_requests=[finished(headers)]))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"llm_request", "queue", "prefill", "decode"}
    request = spans["llm_request"]
    assert request.kind == SpanKind.SERVER
    # It continues the caller's trace, under the caller's span.
    assert format(request.context.trace_id, "032x") == TRACE_ID
    assert request.parent is not None and format(request.parent.span_id, "016x") == PARENT_ID
    assert (request.start_time, request.end_time) == (100_000_000_000, 103_000_000_000)
    attrs = dict(request.attributes or {})
    assert attrs["gen_ai.request.id"] == "cmpl-1-0"
    assert attrs["gen_ai.response.model"] == "my-model"
    assert attrs["gen_ai.usage.prompt_tokens"] == 40
    assert attrs["gen_ai.usage.completion_tokens"] == 9
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == 32
    assert attrs["gen_ai.request.max_tokens"] == 9
    assert attrs["gen_ai.request.temperature"] == 0.5
    assert attrs["gen_ai.request.top_p"] == 0.9
    assert attrs["gen_ai.request.n"] == 1
    assert attrs["gen_ai.latency.time_in_queue"] == 0.5
    assert attrs["gen_ai.latency.time_to_first_token"] == 1.0
    assert attrs["gen_ai.latency.time_in_model_prefill"] == 0.5
    assert attrs["gen_ai.latency.time_in_model_decode"] == 2.0
    assert attrs["gen_ai.latency.e2e"] == 3.0
    assert attrs["tokenloom.num_preemptions"] == 2
    assert [(e.name, e.timestamp) for e in request.events] == [
        ("preempted", 101_500_000_000),
        ("preempted", 102_000_000_000),
    ]
    for name, start, end in (
        ("queue", 100.0, 100.5),
        ("prefill", 100.5, 101.0),
        ("decode", 101.0, 103.0),
    ):
        phase = spans[name]
        assert phase.parent is not None and phase.parent.span_id == request.context.span_id
        assert (phase.start_time, phase.end_time) == (int(start * 1e9), int(end * 1e9))


def test_without_trace_context_the_span_starts_a_trace() -> None:
    tracer, exporter = traced()
    tracer.record(None, IterationStats(finished_requests=[finished(None)]))
    request = next(s for s in exporter.get_finished_spans() if s.name == "llm_request")
    assert request.parent is None


def test_the_exporter_gets_the_standard_path_and_a_bad_protocol_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exporter = span_exporter("http://127.0.0.1:4318")
    assert exporter._endpoint == "http://127.0.0.1:4318/v1/traces"  # type: ignore[attr-defined]
    exporter = span_exporter("http://collector:9999/custom")
    assert exporter._endpoint == "http://collector:9999/custom"  # type: ignore[attr-defined]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        span_exporter("http://127.0.0.1:4318")
