"""The one stop mechanism: ``stopping_token_ids`` and ``Request.append_output_token_ids``.

Every path that gives a request tokens (one decoded token, accepted drafts plus
a bonus token) goes through ``append_output_token_ids``, which returns None
while the request runs on and the tokens it kept once it finished; these tests
pin down what it keeps and how it finishes the request, and compare it with a
plain token-by-token reference on random inputs.
"""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.core.utils import FakeRunner, Harness, assert_no_leaks, make_scheduler, scripted
from tokenloom.request import Request, RequestStatus, stopping_token_ids
from tokenloom.sampling_params import SamplingParams

EOS = 2
STOPPED = RequestStatus.FINISHED_STOPPED
LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED
RUNNING = RequestStatus.RUNNING


def _request(prompt_len: int = 3, eos: int | None = EOS, **params: object) -> Request:
    request = Request("r", list(range(100, 100 + prompt_len)), SamplingParams(**params), eos)  # type: ignore[arg-type]
    request.status = RUNNING
    return request


def test_stopping_token_ids_is_eos_unless_ignored_plus_stop_ids() -> None:
    assert stopping_token_ids(SamplingParams(), EOS) == {EOS}
    assert stopping_token_ids(SamplingParams(), None) == frozenset()
    assert stopping_token_ids(SamplingParams(ignore_eos=True), EOS) == frozenset()
    assert stopping_token_ids(SamplingParams(stop_token_ids=[5, 6]), EOS) == {5, 6, EOS}
    assert stopping_token_ids(SamplingParams(stop_token_ids=[5], ignore_eos=True), EOS) == {5}
    # Requests with only an EOS share one set object (read by every running request).
    assert stopping_token_ids(SamplingParams(), 7) is stopping_token_ids(SamplingParams(), 7)
    request = Request("r", [1], SamplingParams(stop_token_ids=[9]), eos_token_id=EOS)
    assert request.stopping_token_ids == {9, EOS}


def test_multi_token_append_stops_in_the_middle() -> None:
    request = _request(stop_token_ids=[11])
    kept = request.append_output_token_ids([5, 11, 6, 7], 4096)
    assert kept == [5, 11]
    assert request.output_token_ids == [5, 11]
    assert request.all_token_ids == [100, 101, 102, 5, 11]
    assert request.num_tokens == 5 and request.num_output_tokens == 2
    assert request.status == STOPPED and request.stop_reason == 11


def test_eos_stops_with_no_stop_reason_and_ignore_eos_runs_on() -> None:
    request = _request()
    assert request.append_output_token_ids([5], 4096) is None
    assert request.status == RUNNING
    assert request.append_output_token_ids([EOS], 4096) == [EOS]
    assert request.status == STOPPED and request.stop_reason is None

    ignoring = _request(ignore_eos=True)
    assert ignoring.append_output_token_ids([EOS, EOS], 4096) is None
    assert ignoring.append_output_token_ids([EOS], 4096) is None
    assert ignoring.output_token_ids == [EOS] * 3 and ignoring.status == RUNNING
    # With ignore_eos, the EOS id listed as a stop id is an ordinary stop id.
    listed = _request(ignore_eos=True, stop_token_ids=[EOS])
    assert listed.append_output_token_ids([4, EOS, 5], 4096) == [4, EOS]
    assert listed.status == STOPPED and listed.stop_reason == EOS


@pytest.mark.parametrize("chunked", [False, True])
def test_min_tokens_ignores_stops_through_that_many_outputs(chunked: bool) -> None:
    request = _request(stop_token_ids=[11], min_tokens=3)
    tokens = [EOS, 11, EOS, 11, 5]
    if chunked:
        assert request.append_output_token_ids(tokens, 4096) == [EOS, 11, EOS, 11]
    else:
        for token in tokens[:3]:
            assert request.append_output_token_ids([token], 4096) is None
        assert request.append_output_token_ids([tokens[3]], 4096) == [11]
    # Output number 4 is the first that may stop.
    assert request.output_token_ids == [EOS, 11, EOS, 11]
    assert request.status == STOPPED and request.stop_reason == 11


@pytest.mark.parametrize("chunked", [False, True])
def test_stop_token_wins_over_a_length_cap_on_the_same_token(chunked: bool) -> None:
    request = _request(max_tokens=3)
    if chunked:
        assert request.append_output_token_ids([5, 6, EOS, 7], 4096) == [5, 6, EOS]
    else:
        assert request.append_output_token_ids([5], 4096) is None
        assert request.append_output_token_ids([6], 4096) is None
        assert request.append_output_token_ids([EOS], 4096) == [EOS]
    assert request.status == STOPPED and request.stop_reason is None
    # One token earlier the cap wins.
    capped = _request(max_tokens=2)
    assert capped.append_output_token_ids([5, 6, EOS], 4096) == [5, 6]
    assert capped.status == LENGTH and capped.stop_reason is None


def test_max_model_len_caps_prompt_plus_output() -> None:
    request = _request(prompt_len=3, max_tokens=None)
    assert request.append_output_token_ids([5], 6) is None
    assert request.append_output_token_ids([6, 7, 8], 6) == [6, 7]
    assert request.num_tokens == 6 and request.status == LENGTH
    # A prompt already at max_model_len still yields one token.
    full = _request(prompt_len=6, max_tokens=None)
    assert full.append_output_token_ids([5, 6], 6) == [5]
    assert full.status == LENGTH


def test_the_length_cap_follows_the_max_model_len_given() -> None:
    request = _request(prompt_len=3, max_tokens=None)
    assert request.append_output_token_ids([5], 100) is None
    assert request.append_output_token_ids([6], 100) is None
    assert request.append_output_token_ids([7], 6) == [7]  # 6 tokens: at a cap of 6
    assert request.status == LENGTH


def test_an_empty_list_changes_nothing() -> None:
    request = _request(prompt_len=6, max_tokens=None)
    assert request.append_output_token_ids([], 6) is None
    assert request.num_tokens == 6 and request.status == RUNNING


def _reference(
    request: Request, chunks: list[list[int]], max_model_len: int
) -> tuple[list[int], RequestStatus, int | None]:
    """Token by token, straight from the definition."""
    params = request.sampling_params
    eos = request.eos_token_id
    stops = set(params.stop_token_ids or ())
    if eos is not None and not params.ignore_eos:
        stops.add(eos)
    max_tokens = sys.maxsize if params.max_tokens is None else params.max_tokens
    out: list[int] = []
    for token in [t for chunk in chunks for t in chunk]:
        out.append(token)
        if token in stops and len(out) > params.min_tokens:
            is_eos = token == eos and not params.ignore_eos
            return out, STOPPED, None if is_eos else token
        if len(out) >= max_tokens or request.num_prompt_tokens + len(out) >= max_model_len:
            return out, LENGTH, None
    return out, RUNNING, None


@settings(max_examples=300, deadline=None)
@given(
    prompt_len=st.integers(1, 6),
    max_model_len=st.integers(1, 16),
    max_tokens=st.one_of(st.none(), st.integers(1, 10)),
    min_tokens=st.integers(0, 4),
    eos=st.one_of(st.none(), st.integers(0, 4)),
    ignore_eos=st.booleans(),
    stop_ids=st.one_of(st.none(), st.lists(st.integers(0, 4), max_size=2)),
    chunks=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), max_size=8),
)
def test_append_matches_a_token_by_token_reference(
    prompt_len: int,
    max_model_len: int,
    max_tokens: int | None,
    min_tokens: int,
    eos: int | None,
    ignore_eos: bool,
    stop_ids: list[int] | None,
    chunks: list[list[int]],
) -> None:
    min_tokens = min(min_tokens, max_tokens or min_tokens)
    params = dict(
        max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_ids
    )
    request = _request(prompt_len, eos, **params)
    expected, status, stop_reason = _reference(
        _request(prompt_len, eos, **params), chunks, max_model_len
    )
    kept: list[int] = []
    for chunk in chunks:
        if request.status != RUNNING:
            break
        appended = request.append_output_token_ids(chunk, max_model_len)
        if appended is None:
            assert request.status == RUNNING
            appended = chunk
        else:
            assert request.status != RUNNING and appended == chunk[: len(appended)]
        kept += appended
    assert kept == expected == request.output_token_ids
    assert request.all_token_ids == request.prompt_token_ids + expected
    assert request.num_tokens == len(request.all_token_ids)
    assert request.status == status and request.stop_reason == stop_reason


def test_the_scheduler_finishes_drafts_and_decodes_through_the_same_rules() -> None:
    """Accepted drafts past min_tokens stop at the first stop id; a decoded stop id within
    min_tokens does not."""
    runner = FakeRunner(token_source=scripted({"a": [11, 5, 11, 7], "b": [11, 11, 11]}))
    h = Harness(make_scheduler(num_speculative_tokens=3), runner)
    h.add(
        Request("a", [1, 2, 3], SamplingParams(stop_token_ids=[11], min_tokens=3), EOS),
        Request("b", [4, 5, 6], SamplingParams(stop_token_ids=[11], min_tokens=2), EOS),
    )
    h.step()  # prefill: a gets 11 (ignored), b gets 11 (ignored)
    h.scheduler.update_draft_token_ids({"a": [5, 11, 9]})
    h.step()  # a accepts 5, 11 (output 3: ignored), 9 and a bonus 5; b gets 11 (ignored)
    assert h.tokens("a") == [11, 5, 11, 9, 5] and "a" not in h.finished
    h.scheduler.update_draft_token_ids({"a": [6, 11, 8]})
    h.run_until_done()  # a accepts 6 then stops on 11 (the draft 8 and bonus are dropped)
    assert h.tokens("a") == [11, 5, 11, 9, 5, 6, 11]
    assert h.finished["a"].stop_reason == 11
    assert h.tokens("b") == [11, 11, 11]
    assert h.finished["b"].stop_reason == 11
    assert_no_leaks(h.scheduler)
