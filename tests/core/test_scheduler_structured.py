"""Structured requests through the scheduler: waiting for the grammar, bitmasks, the end.

The grammar backend runs for real on a tiny hand-made vocabulary; the model
is the FakeRunner (it does not apply masks, so tests script its tokens).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.core.utils import (
    FakeRunner,
    Harness,
    assert_no_leaks,
    finish_all,
    make_request,
    make_scheduler,
    scripted,
)
from tokenloom.request import RequestStatus
from tokenloom.structured_output import StructuredOutputsParams
from tokenloom.structured_output.manager import StructuredOutputManager
from tokenloom.structured_output.reasoning_gate import ReasoningGate

EOS = 0
VOCAB = ["<eos>", "a", "b", "c", "ab", "x"]
A, B, C, AB, X = 1, 2, 3, 4, 5


def _tiny_info() -> Any:
    import xgrammar as xgr

    return xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, stop_token_ids=[EOS])


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """Compiles wait for this event (set by default: no waiting)."""
    event = threading.Event()
    event.set()
    yield event
    event.set()


@pytest.fixture
def manager(gate: threading.Event) -> Iterator[StructuredOutputManager]:
    def factory() -> Any:
        gate.wait(10)
        return _tiny_info()

    manager = StructuredOutputManager(factory, len(VOCAB), [EOS])
    yield manager
    manager.shutdown()


def _structured(req_id: str, prompt: int = 3, **kwargs: Any) -> Any:
    constraint = kwargs.pop("constraint", StructuredOutputsParams(regex="(ab|c)+"))
    return make_request(req_id, prompt, eos_token_id=EOS, structured_outputs=constraint, **kwargs)


def _wait_compiled(scheduler: Any) -> None:
    """Until every structured request's compile finished (successfully or not)."""
    deadline = time.monotonic() + 10
    for request in list(scheduler.requests.values()):
        structured = request.structured_output_request
        while structured is not None and not structured.is_ready():
            assert time.monotonic() < deadline, "grammar did not compile"
            time.sleep(0.002)


def test_without_a_manager_structured_requests_are_refused() -> None:
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match="structured_outputs needs"):
        scheduler.add_request(_structured("s"))
    assert_no_leaks(scheduler)


def test_compiling_requests_wait_and_keep_their_place(
    manager: StructuredOutputManager, gate: threading.Event
) -> None:
    gate.clear()
    scheduler = make_scheduler(structured_output_manager=manager)
    runner = FakeRunner(scripted({"s": [AB, C, EOS]}, default=EOS))
    harness = Harness(scheduler, runner)
    harness.add(_structured("s"), make_request("free", 3, max_tokens=2))
    assert scheduler.requests["s"].status == RequestStatus.WAITING_FOR_FSM
    assert not RequestStatus.is_finished(RequestStatus.WAITING_FOR_FSM)

    so = harness.step()
    # The free request overtakes the compiling one, which stays first in the queue.
    assert list(so.num_scheduled_tokens) == ["free"]
    assert [r.request_id for r in scheduler.waiting] == ["s"]
    assert scheduler.get_request_counts() == (1, 1)
    assert scheduler.get_grammar_bitmask(so) is None  # no structured request sampled

    gate.set()
    _wait_compiled(scheduler)
    harness.run_until_done()
    assert harness.tokens("s") == [AB, C, EOS]
    assert harness.finished["s"].finish_reason == "stop"
    assert_no_leaks(scheduler)


def test_bitmask_rows_only_for_structured_requests_that_sample(
    manager: StructuredOutputManager,
) -> None:
    # A 4-token budget: the long prompt is prefilled in chunks (no sampling, no row).
    scheduler = make_scheduler(
        structured_output_manager=manager, max_num_batched_tokens=8, block_size=4
    )
    harness = Harness(scheduler, FakeRunner(scripted({}, default=C)))
    harness.add(
        _structured("short", prompt=2, max_tokens=3),
        make_request("free", 2, max_tokens=3),
        _structured("long", prompt=20, max_tokens=3),
    )
    _wait_compiled(scheduler)
    so = harness.schedule()
    grammar = scheduler.get_grammar_bitmask(so)
    assert grammar is not None
    assert grammar.structured_output_request_ids == ["short"]
    assert grammar.rows_per_request == [1]
    allowed = np.unpackbits(grammar.grammar_bitmask[0].view(np.uint8), bitorder="little")
    # (ab|c)+ at the start: a, ab or c, never b, x or EOS.
    assert np.flatnonzero(allowed[: len(VOCAB)]).tolist() == [A, C, AB]
    harness.run(so)
    harness.run_until_done()
    assert [harness.finished[r].finish_reason for r in ("short", "free", "long")] == ["length"] * 3
    assert_no_leaks(scheduler)


def test_grammar_end_stops_the_request_even_with_ignore_eos(
    manager: StructuredOutputManager,
) -> None:
    scheduler = make_scheduler(structured_output_manager=manager)
    runner = FakeRunner(scripted({"s": [A, B, EOS, A]}, default=A))
    harness = Harness(scheduler, runner)
    harness.add(
        _structured("s", constraint=StructuredOutputsParams(choice=["ab"]), ignore_eos=True)
    )
    _wait_compiled(scheduler)
    harness.run_until_done()
    assert harness.tokens("s") == [A, B, EOS]
    assert harness.finished["s"].finish_reason == "stop"
    assert harness.finished["s"].stop_reason is None
    assert_no_leaks(scheduler)


def test_a_token_the_grammar_refuses_aborts_only_that_request(
    manager: StructuredOutputManager,
) -> None:
    scheduler = make_scheduler(structured_output_manager=manager)
    runner = FakeRunner(scripted({"s": [C, X], "free": [X, X, X]}))
    harness = Harness(scheduler, runner)
    harness.add(_structured("s"), make_request("free", 3, max_tokens=3))
    _wait_compiled(scheduler)
    harness.run_until_done()
    assert harness.tokens("s") == [C]
    assert harness.finished["s"].finish_reason == "abort"
    assert harness.tokens("free") == [X, X, X]
    assert_no_leaks(scheduler)


def test_a_grammar_that_fails_to_compile_aborts_its_request(
    manager: StructuredOutputManager,
) -> None:
    scheduler = make_scheduler(structured_output_manager=manager)
    harness = Harness(scheduler)
    harness.add(
        _structured("bad", constraint=StructuredOutputsParams(regex="(")),
        make_request("free", 3, max_tokens=2),
    )
    _wait_compiled(scheduler)
    harness.run_until_done()
    assert harness.finished["bad"].finish_reason == "abort"
    assert harness.tokens("bad") == []
    assert harness.finished["free"].finish_reason == "length"
    assert_no_leaks(scheduler)


def test_drafts_are_cut_at_the_grammar_and_rows_cover_them(
    manager: StructuredOutputManager,
) -> None:
    scheduler = make_scheduler(structured_output_manager=manager, num_speculative_tokens=3)
    # The fake model accepts one draft per step, then samples C.
    runner = FakeRunner(scripted({}, default=C), accept=lambda _r, drafts: min(1, len(drafts)))
    harness = Harness(scheduler, runner)
    harness.add(_structured("s", max_tokens=8))
    _wait_compiled(scheduler)
    harness.step()  # prefill, samples C
    scheduler.update_draft_token_ids({"s": [AB, B, C]})  # B is refused after AB
    request = scheduler.requests["s"]
    assert request.spec_token_ids == [AB]
    so = harness.schedule()
    grammar = scheduler.get_grammar_bitmask(so)
    assert grammar is not None and grammar.rows_per_request == [2]
    matcher = request.structured_output_request.grammar  # type: ignore[union-attr]
    assert matcher is not None and matcher.num_processed_tokens == 1  # filling moved nothing
    harness.run(so)
    assert harness.tokens("s") == [C, AB, C]
    assert matcher.num_processed_tokens == 3  # exactly the accepted tokens
    finish_all(scheduler)
    harness.step()
    assert_no_leaks(scheduler)


def test_aborting_a_compiling_request(
    manager: StructuredOutputManager, gate: threading.Event
) -> None:
    gate.clear()
    scheduler = make_scheduler(structured_output_manager=manager)
    scheduler.add_request(_structured("s"))
    finish_all(scheduler)
    gate.set()
    _wait_compiled(scheduler)
    assert scheduler.get_grammar_bitmask(scheduler.schedule()) is None
    assert_no_leaks(scheduler)


def test_stats_count_requests_compiles_and_cache_hits(manager: StructuredOutputManager) -> None:
    scheduler = make_scheduler(structured_output_manager=manager, log_stats=True)
    harness = Harness(scheduler, FakeRunner(scripted({}, default=C)))
    harness.add(*[_structured(f"s{i}", max_tokens=2) for i in range(4)])
    harness.add(_structured("other", max_tokens=2, constraint=StructuredOutputsParams(regex="c+")))
    _wait_compiled(scheduler)
    stats = scheduler.make_stats()
    assert stats is not None
    assert stats.num_structured_requests == 5
    assert stats.grammar_cache_hits == 3  # four requests, one schema: compiled once
    assert len(stats.grammar_compile_times) == 2
    harness.run_until_done()
    assert_no_leaks(scheduler)


def _resumed(req_id: str, prior: list[int]) -> Any:
    """A structured request resumed after an engine crash with output ``prior``."""
    from tokenloom.request import Request

    fresh = _structured(req_id, max_tokens=6)
    return Request(
        req_id,
        fresh.prompt_token_ids,
        fresh.sampling_params,
        eos_token_id=EOS,
        prior_output_token_ids=prior,
    )


def test_a_resumed_request_continues_its_grammar_after_its_output(
    manager: StructuredOutputManager,
) -> None:
    scheduler = make_scheduler(structured_output_manager=manager)
    harness = Harness(scheduler, FakeRunner(scripted({"s": [C, EOS]}, default=X)))
    harness.add(_resumed("s", [AB]))
    _wait_compiled(scheduler)
    so = harness.schedule()
    grammar = scheduler.get_grammar_bitmask(so)
    assert grammar is not None
    allowed = np.unpackbits(grammar.grammar_bitmask[0].view(np.uint8), bitorder="little")
    # After "ab", (ab|c)+ may end: EOS is allowed now, as it would be without the crash.
    assert np.flatnonzero(allowed[: len(VOCAB)]).tolist() == [EOS, A, C, AB]
    harness.run(so)
    harness.run_until_done()
    assert harness.finished["s"].finish_reason == "stop"
    assert_no_leaks(scheduler)


def test_a_resumed_output_the_grammar_refuses_aborts_the_request(
    manager: StructuredOutputManager,
) -> None:
    scheduler = make_scheduler(structured_output_manager=manager)
    harness = Harness(scheduler, FakeRunner(scripted({}, default=C)))
    harness.add(_resumed("s", [X]))
    _wait_compiled(scheduler)
    harness.run_until_done()
    assert harness.finished["s"].finish_reason == "abort"
    assert_no_leaks(scheduler)


# ---------------------------------------------------------------- reasoning models
# The gate's tags, in the tiny vocabulary: X ends the thinking, B may open it.
THINK_END, THINK_START = X, B


def _thinking(req_id: str, optional: bool = False, **kwargs: Any) -> Any:
    gate = ReasoningGate(THINK_END, THINK_START if optional else None)
    constraint = StructuredOutputsParams(regex="(ab|c)+", reasoning_gate=gate)
    return _structured(req_id, constraint=constraint, **kwargs)


def _allowed(grammar: Any, row: int = 0) -> list[int]:
    bits = np.unpackbits(grammar.grammar_bitmask[row].view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[: len(VOCAB)]).tolist()


def test_the_grammar_starts_after_the_thinking(manager: StructuredOutputManager) -> None:
    scheduler = make_scheduler(structured_output_manager=manager)
    # B and A are refused by (ab|c)+ at its start: only the thinking may hold them.
    runner = FakeRunner(scripted({"s": [B, A, B, THINK_END, AB, C, EOS]}, default=X))
    harness = Harness(scheduler, runner)
    harness.add(_thinking("s", max_tokens=10))
    _wait_compiled(scheduler)
    for _ in range(4):  # the prefill and three thinking tokens: no row, nothing masked
        so = harness.schedule()
        assert scheduler.get_grammar_bitmask(so) is None
        harness.run(so)
    so = harness.schedule()  # after the end token: the grammar's first row
    grammar = scheduler.get_grammar_bitmask(so)
    assert grammar is not None and _allowed(grammar) == [A, C, AB]
    harness.run(so)
    harness.run_until_done()
    assert harness.tokens("s") == [B, A, B, THINK_END, AB, C, EOS]
    assert harness.finished["s"].finish_reason == "stop"
    assert_no_leaks(scheduler)


def test_an_answer_the_grammar_refuses_still_aborts(manager: StructuredOutputManager) -> None:
    scheduler = make_scheduler(structured_output_manager=manager)
    harness = Harness(scheduler, FakeRunner(scripted({"s": [A, THINK_END, B]}, default=C)))
    harness.add(_thinking("s"))
    _wait_compiled(scheduler)
    harness.run_until_done()
    assert harness.tokens("s") == [A, THINK_END]
    assert harness.finished["s"].finish_reason == "abort"
    assert_no_leaks(scheduler)


def test_optional_thinking_first_row_allows_the_start_tag(
    manager: StructuredOutputManager,
) -> None:
    scheduler = make_scheduler(structured_output_manager=manager)
    scripts = {"answers": [C, AB, EOS], "thinks": [THINK_START, A, THINK_END, C, EOS]}
    harness = Harness(scheduler, FakeRunner(scripted(scripts, default=X)))
    harness.add(_thinking("answers", optional=True), _thinking("thinks", optional=True))
    _wait_compiled(scheduler)
    so = harness.schedule()
    grammar = scheduler.get_grammar_bitmask(so)
    assert grammar is not None and grammar.structured_output_request_ids == ["answers", "thinks"]
    assert _allowed(grammar, 0) == _allowed(grammar, 1) == [A, THINK_START, C, AB]
    harness.run(so)
    # "answers" answered at once (its grammar moved); "thinks" thinks, without a row.
    so = harness.schedule()
    grammar = scheduler.get_grammar_bitmask(so)
    assert grammar is not None and grammar.structured_output_request_ids == ["answers"]
    assert _allowed(grammar) == [EOS, A, C, AB]
    harness.run(so)
    harness.run_until_done()
    assert harness.tokens("answers") == [C, AB, EOS]
    assert harness.tokens("thinks") == [THINK_START, A, THINK_END, C, EOS]
    assert [harness.finished[r].finish_reason for r in ("answers", "thinks")] == ["stop"] * 2
    assert_no_leaks(scheduler)


def test_drafts_of_a_thinking_request_stop_before_the_end_tag(
    manager: StructuredOutputManager,
) -> None:
    scheduler = make_scheduler(structured_output_manager=manager, num_speculative_tokens=4)
    runner = FakeRunner(scripted({"s": [A]}, default=THINK_END))
    harness = Harness(scheduler, runner)
    harness.add(_thinking("s", max_tokens=8))
    _wait_compiled(scheduler)
    harness.step()
    scheduler.update_draft_token_ids({"s": [B, A, THINK_END, C]})
    assert scheduler.requests["s"].spec_token_ids == [B, A]
    finish_all(scheduler)
    harness.step()
    assert_no_leaks(scheduler)


def test_a_resumed_request_skips_its_thinking(manager: StructuredOutputManager) -> None:
    from tokenloom.request import Request

    scheduler = make_scheduler(structured_output_manager=manager)
    harness = Harness(scheduler, FakeRunner(scripted({"s": [C, EOS]}, default=X)))
    fresh = _thinking("s", max_tokens=8)
    harness.add(
        Request(
            "s",
            fresh.prompt_token_ids,
            fresh.sampling_params,
            eos_token_id=EOS,
            prior_output_token_ids=[B, A, THINK_END, AB],
        )
    )
    _wait_compiled(scheduler)
    so = harness.schedule()
    grammar = scheduler.get_grammar_bitmask(so)
    assert grammar is not None and _allowed(grammar) == [EOS, A, C, AB]
    harness.run(so)
    harness.run_until_done()
    assert harness.finished["s"].finish_reason == "stop"
    assert_no_leaks(scheduler)
