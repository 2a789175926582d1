"""Request traces from the real server to an OTLP receiver in this process.

A streamed chat completion that carries a W3C ``traceparent`` must come back
as vLLM's ``llm_request`` span in the caller's trace, with the usage the
client saw, the latencies, and queue/prefill/decode child spans; a second
request with the same prompt shows its prefix-cache hit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from .otlp_receiver import OTLPReceiver, attributes
from .server_utils import RemoteServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MODEL = "SmolLM2-135M-Instruct"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
# Long enough to fill a few KV blocks (16 tokens each) that the second request hits.
CONTENT = "Tell me about the history of the city of Paris, its rivers, bridges and museums. " * 3


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    r = OTLPReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def server(
    receiver: OTLPReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--max-model-len", "512", "--num-blocks", "128", "--max-num-seqs", "4"]
    args += ["--otlp-traces-endpoint", receiver.url]
    # Spans leave the batch processor within 100 ms rather than 5 s.
    server = RemoteServer(args, log, env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    yield server
    server.stop()


def stream_chat(server: RemoteServer, traceparent: str | None) -> dict[str, int]:
    """A streamed chat completion; its usage, from the final chunk."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": CONTENT}],
        "max_tokens": 8,
        "temperature": 0.5,
        "top_p": 0.9,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"traceparent": traceparent} if traceparent else {}
    usage: dict[str, int] = {}
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
    assert usage, "no usage chunk"
    return usage


def request_span(
    spans: list[Span], request_id: str | None = None, trace_id: str | None = None
) -> Span | None:
    for span in spans:
        if span.name != "llm_request":
            continue
        if trace_id is not None and span.trace_id.hex() != trace_id:
            continue
        if request_id is not None and not attributes(span)["gen_ai.request.id"].startswith(
            request_id
        ):
            continue
        return span
    return None


def test_a_streamed_request_becomes_a_span_in_the_callers_trace(
    server: RemoteServer, receiver: OTLPReceiver
) -> None:
    usage = stream_chat(server, f"00-{TRACE_ID}-{PARENT_ID}-01")
    span = receiver.wait_for(lambda spans: request_span(spans, trace_id=TRACE_ID))
    assert span.kind == Span.SpanKind.SPAN_KIND_SERVER
    assert span.parent_span_id.hex() == PARENT_ID
    attrs = attributes(span)
    assert attrs["gen_ai.response.model"] == MODEL
    assert attrs["gen_ai.request.id"].startswith("chatcmpl-")
    assert attrs["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.completion_tokens"] == usage["completion_tokens"]
    assert attrs["gen_ai.request.max_tokens"] == 8
    assert attrs["gen_ai.request.temperature"] == 0.5
    assert attrs["gen_ai.request.top_p"] == 0.9
    assert attrs["tokenloom.num_preemptions"] == 0
    queue = attrs["gen_ai.latency.time_in_queue"]
    ttft = attrs["gen_ai.latency.time_to_first_token"]
    e2e = attrs["gen_ai.latency.e2e"]
    assert 0 <= queue < ttft <= e2e
    assert attrs["gen_ai.latency.time_in_model_prefill"] > 0
    assert span.end_time_unix_nano - span.start_time_unix_nano == pytest.approx(e2e * 1e9, rel=0.01)
    children = {
        s.name: s
        for s in receiver.spans
        if s.trace_id == span.trace_id and s.parent_span_id == span.span_id
    }
    assert set(children) == {"queue", "prefill", "decode"}
    assert children["queue"].start_time_unix_nano == span.start_time_unix_nano
    assert children["queue"].end_time_unix_nano == children["prefill"].start_time_unix_nano
    assert children["prefill"].end_time_unix_nano == children["decode"].start_time_unix_nano
    assert children["decode"].end_time_unix_nano == span.end_time_unix_nano


def test_a_repeated_prompt_shows_its_prefix_cache_hit(
    server: RemoteServer, receiver: OTLPReceiver
) -> None:
    first_trace, second_trace = "1" * 32, "2" * 32
    stream_chat(server, f"00-{first_trace}-{PARENT_ID}-01")
    usage = stream_chat(server, f"00-{second_trace}-{PARENT_ID}-01")
    first = receiver.wait_for(lambda spans: request_span(spans, trace_id=first_trace))
    second = receiver.wait_for(lambda spans: request_span(spans, trace_id=second_trace))
    cached = attributes(second)["gen_ai.usage.cache_read.input_tokens"]
    assert cached >= 16 * (usage["prompt_tokens"] // 16 - 1)
    assert attributes(first)["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
