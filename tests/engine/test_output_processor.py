"""OutputProcessor with hand-written core outputs: fan-out, deltas, stops, logprobs, stats."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tokenloom.engine.exceptions import EngineDeadError
from tokenloom.engine.input_processor import InputProcessor
from tokenloom.engine.output_processor import OutputProcessor, RequestOutputCollector
from tokenloom.metrics.stats import IterationStats
from tokenloom.outputs import EngineCoreOutput, TokenLogprobs
from tokenloom.request import FinishReason
from tokenloom.sampling_params import SamplingParams

EOS = 2


@pytest.fixture()
def inputs(tokenizer: Any) -> InputProcessor:
    return InputProcessor(tokenizer, max_model_len=256, vocab_size=49152, eos_token_ids=[EOS])


def out(
    req_id: str, tokens: list[int], finish: FinishReason | None = None, **kw: Any
) -> EngineCoreOutput:
    return EngineCoreOutput(req_id, tokens, finish, **kw)


def test_n_completions_gathered_in_index_order(tokenizer: Any, inputs: InputProcessor) -> None:
    text, reqs = inputs.process("p", "Hello", SamplingParams(n=2, max_tokens=4))
    assert [r.request_id for r in reqs] == ["0_p", "1_p"]
    proc = OutputProcessor(tokenizer)
    proc.add_request("p", text, reqs)
    a, b = tokenizer.encode(" one"), tokenizer.encode(" two")
    # The second completion finishes first; nothing is returned until both have.
    step1 = proc.process_outputs([out("1_p", b, FinishReason.LENGTH), out("0_p", a)], 1.0)
    assert step1.request_outputs == []
    step2 = proc.process_outputs([out("0_p", [EOS], FinishReason.STOP)], 2.0)
    (result,) = step2.request_outputs
    assert result.request_id == "p" and result.prompt == "Hello" and result.finished
    assert [c.index for c in result.outputs] == [0, 1]
    assert result.outputs[0].text == " one" and result.outputs[0].token_ids == a + [EOS]
    assert result.outputs[0].finish_reason == "stop"
    assert result.outputs[1].text == " two" and result.outputs[1].finish_reason == "length"
    assert not proc.has_unfinished_requests()


def test_stop_string_finishes_and_asks_core_to_abort(
    tokenizer: Any, inputs: InputProcessor
) -> None:
    _, reqs = inputs.process("r", [5, 6], SamplingParams(stop=["two"], max_tokens=20))
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, reqs)
    ids = tokenizer.encode("one two three")
    step = proc.process_outputs([out("r", ids)], 1.0)
    assert step.reqs_to_abort == ["r"]
    (result,) = step.request_outputs
    completion = result.outputs[0]
    assert completion.text == "one " and completion.finish_reason == "stop"
    assert completion.stop_reason == "two"
    # Tokens the core produced before hearing of the abort are dropped.
    assert proc.process_outputs([out("r", [7])], 2.0).request_outputs == []


def test_stop_token_text_excluded_unless_requested(tokenizer: Any, inputs: InputProcessor) -> None:
    dot = tokenizer.encode(".")[0]
    for include, expected in ((False, "Hi"), (True, "Hi.")):
        params = SamplingParams(stop_token_ids=[dot], include_stop_str_in_output=include)
        _, reqs = inputs.process("r", [5], params)
        proc = OutputProcessor(tokenizer)
        proc.add_request("r", None, reqs)
        ids = tokenizer.encode("Hi") + [dot]
        step = proc.process_outputs([out("r", ids, FinishReason.STOP, stop_reason=dot)], 1.0)
        completion = step.request_outputs[0].outputs[0]
        assert completion.text == expected
        assert completion.token_ids == ids and completion.stop_reason == dot


def test_logprobs_become_dicts(tokenizer: Any, inputs: InputProcessor) -> None:
    _, reqs = inputs.process("r", [5], SamplingParams(logprobs=1, max_tokens=2))
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, reqs)
    lps = [TokenLogprobs([10, 11], [-0.5, -1.5]), TokenLogprobs([12, 12], [-0.1, -0.1])]
    step = proc.process_outputs([out("r", [10, 12], FinishReason.LENGTH, new_logprobs=lps)], 1.0)
    assert step.request_outputs[0].outputs[0].logprobs == [{10: -0.5, 11: -1.5}, {12: -0.1}]


async def test_delta_collector_merges_and_stream_concatenates(
    tokenizer: Any, inputs: InputProcessor
) -> None:
    _, reqs = inputs.process("r", [5], SamplingParams(max_tokens=20))
    proc = OutputProcessor(tokenizer)
    collector = RequestOutputCollector(delta=True)
    proc.add_request("r", None, reqs, collector)
    ids = tokenizer.encode("alpha beta gamma delta")
    proc.process_outputs([out("r", ids[:2])], 1.0)
    first = await collector.get()
    # Two steps before the consumer reads: their deltas merge into one output.
    proc.process_outputs([out("r", ids[2:3])], 2.0)
    proc.process_outputs([out("r", ids[3:], FinishReason.LENGTH)], 3.0)
    second = await collector.get()
    assert second.finished and not first.finished
    text = first.outputs[0].text + second.outputs[0].text
    tokens = first.outputs[0].token_ids + second.outputs[0].token_ids
    assert text == "alpha beta gamma delta" and tokens == ids


async def test_cumulative_collector_keeps_latest(tokenizer: Any, inputs: InputProcessor) -> None:
    _, reqs = inputs.process("r", [5], SamplingParams(max_tokens=20))
    proc = OutputProcessor(tokenizer)
    collector = RequestOutputCollector(delta=False)
    proc.add_request("r", None, reqs, collector)
    ids = tokenizer.encode("alpha beta")
    proc.process_outputs([out("r", ids[:1])], 1.0)
    proc.process_outputs([out("r", ids[1:])], 2.0)
    latest = await collector.get()
    assert latest.outputs[0].text == "alpha beta" and not latest.finished


async def test_error_reaches_waiting_consumer(tokenizer: Any, inputs: InputProcessor) -> None:
    _, reqs = inputs.process("r", [5], SamplingParams())
    proc = OutputProcessor(tokenizer)
    collector = RequestOutputCollector(delta=True)
    proc.add_request("r", None, reqs, collector)
    waiter = asyncio.ensure_future(collector.get())
    await asyncio.sleep(0)
    proc.propagate_error(EngineDeadError("gone"))
    with pytest.raises(EngineDeadError, match="gone"):
        await asyncio.wait_for(waiter, 1)
    assert not proc.has_unfinished_requests()


def test_abort_returns_unfinished_core_ids(tokenizer: Any, inputs: InputProcessor) -> None:
    _, reqs = inputs.process("p", [5], SamplingParams(n=3))
    proc = OutputProcessor(tokenizer)
    proc.add_request("p", None, reqs)
    proc.process_outputs([out("1_p", [9], FinishReason.LENGTH)], 1.0)
    assert proc.abort_requests(["p", "unknown"]) == ["0_p", "2_p"]
    assert not proc.has_unfinished_requests() and "0_p" not in proc


def test_duplicate_request_id_rejected(tokenizer: Any, inputs: InputProcessor) -> None:
    proc = OutputProcessor(tokenizer)
    _, reqs = inputs.process("r", [5], SamplingParams())
    proc.add_request("r", None, reqs)
    with pytest.raises(ValueError, match="already in use"):
        proc.add_request("r", None, reqs)


def test_iteration_stats(tokenizer: Any, inputs: InputProcessor) -> None:
    _, reqs = inputs.process("r", [5, 6, 7], SamplingParams(max_tokens=3), arrival_time=100.0)
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, reqs)
    s1 = IterationStats()
    proc.process_outputs([out("r", [10])], 101.0, s1, {"r": 100.25})
    assert s1.num_prompt_tokens == 3 and s1.num_generation_tokens == 1
    assert s1.time_to_first_tokens_iter == [1.0] and s1.inter_token_latencies_iter == []
    s2 = IterationStats()
    proc.process_outputs([out("r", [11, 12], FinishReason.LENGTH)], 101.5, s2)
    assert s2.num_prompt_tokens == 0 and s2.num_generation_tokens == 2
    assert s2.inter_token_latencies_iter == [0.5]
    (finished,) = s2.finished_requests
    assert finished.finish_reason == "length"
    assert finished.e2e_latency == pytest.approx(1.5)
    assert finished.queued_time == pytest.approx(0.25)
    assert finished.prefill_time == pytest.approx(0.75)
    assert finished.decode_time == pytest.approx(0.5)
    assert (finished.num_prompt_tokens, finished.num_generation_tokens) == (3, 3)


async def test_abort_ends_a_waiting_stream(tokenizer: Any, inputs: InputProcessor) -> None:
    _, reqs = inputs.process("p", [5], SamplingParams(n=2))
    proc = OutputProcessor(tokenizer)
    collector = RequestOutputCollector(delta=True)
    proc.add_request("p", None, reqs, collector)
    proc.process_outputs([out("0_p", [9], FinishReason.LENGTH)], 1.0)
    await collector.get()
    assert proc.abort_requests(["p"]) == ["1_p"]
    last = await asyncio.wait_for(collector.get(), 1)
    assert last.finished
    assert [(c.index, c.finish_reason) for c in last.outputs] == [(1, "abort")]


def test_timelines_carry_scheduling_preemptions_and_trace_context(
    tokenizer: Any, inputs: InputProcessor
) -> None:
    _, reqs = inputs.process("t", [5, 6, 7], SamplingParams(max_tokens=3), arrival_time=10.0)
    proc = OutputProcessor(tokenizer)
    headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    proc.add_request("t", None, reqs, trace_headers=headers)
    first = IterationStats()
    proc.process_outputs([out("t", [8], num_cached_tokens=2)], 11.0, first, {"t": 10.5})
    [started] = first.started_requests
    assert (started.request_id, started.first_scheduled_time, started.first_token_time) == (
        "t",
        10.5,
        11.0,
    )
    assert started.finish_time is None
    proc.record_preemptions(["t", "unknown"], 11.5)
    last = IterationStats()
    proc.process_outputs([out("t", [9, 10], FinishReason.LENGTH, num_cached_tokens=2)], 12.0, last)
    [done] = last.finished_requests
    assert done.timeline is not None
    assert done.timeline.preemption_times == [11.5]
    assert done.timeline.finish_time == 12.0 and done.timeline.finish_reason == "length"
    assert done.timeline.num_generation_tokens == 3 and done.timeline.num_cached_tokens == 2
    assert done.trace_headers == headers
    assert done.sampling_params is not None and done.sampling_params.max_tokens == 3


async def test_a_pooling_request_ends_with_its_vector(tokenizer: Any) -> None:
    from tokenloom.outputs import PoolingRequestOutput
    from tokenloom.pooling.config import PoolerConfig

    pooler = PoolerConfig(pooling_type="LAST", normalize=True, hidden_size=4)
    inputs = InputProcessor(
        tokenizer, max_model_len=8, vocab_size=49152, eos_token_ids=[EOS], pooler_config=pooler
    )
    text, reqs = inputs.process_pooling("e", "Hello there")
    assert reqs[0].pooling_params is not None and reqs[0].pooling_params.normalize is True
    assert (reqs[0].tenant, reqs[0].tenant_weight) == ("", 1.0)
    _, (other,) = inputs.process_pooling("t", "Hi", tenant="team-a", tenant_weight=2)
    assert (other.tenant, other.tenant_weight) == ("team-a", 2.0)
    with pytest.raises(ValueError, match="^tenant_weight must be a finite number > 0"):
        inputs.process_pooling("w", "Hi", tenant_weight=0)
    proc = OutputProcessor(tokenizer)
    collector: RequestOutputCollector[Any] = RequestOutputCollector(delta=False)
    proc.add_request("e", text, reqs, collector)
    stats = IterationStats()
    vector = b"\x00\x00\x80?" * 4
    result = proc.process_outputs(
        [EngineCoreOutput("e", [], FinishReason.STOP, pooling_output=vector)], 1.0, stats
    )
    assert result.request_outputs == [] and not proc.has_unfinished_requests()
    output = await collector.get()
    assert isinstance(output, PoolingRequestOutput) and output.finished
    assert output.outputs.raw == vector and output.outputs.data == [1.0] * 4
    assert output.prompt_token_ids == reqs[0].prompt_token_ids
    assert stats.num_prompt_tokens == len(reqs[0].prompt_token_ids)
    assert stats.num_generation_tokens == 0
    with pytest.raises(ValueError, match="^prompt is 9 tokens, more than the maximum context"):
        inputs.process_pooling("long", list(range(9)))
    with pytest.raises(ValueError, match="^model: this engine runs the pooling runner"):
        inputs.process("g", "Hello", SamplingParams())
