"""Reasoning parsers: the thinking apart from the answer, the same whole or streamed.

Fuzzed with hypothesis: random thinking and answers, with and without the
start tag, cut anywhere (``max_tokens``) and split anywhere into stream
deltas; every view of a prefix must be a prefix of the final split.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.reasoning import StartPhase, get_reasoning_parser, reasoning_parser_names

QWEN3 = get_reasoning_parser("qwen3")
R1 = get_reasoning_parser("deepseek_r1")
# Text with tag characters but never a whole tag.
_TEXT = st.text(alphabet=" \nab.<>/tk", max_size=15)


def _split(parser, text: str, phase: StartPhase) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    return parser.split(text, phase, final=True)


def _assert_prefix_stable(parser, text: str, phase: StartPhase) -> None:  # type: ignore[no-untyped-def]
    reasoning, content = parser.split(text, phase, final=True)
    for end in range(len(text) + 1):
        seen_reasoning, seen_content = parser.split(text[:end], phase, final=False)
        assert reasoning.startswith(seen_reasoning), (text[:end], seen_reasoning)
        assert content.startswith(seen_content), (text[:end], seen_content)


def test_names() -> None:
    assert reasoning_parser_names() == ["deepseek_r1", "qwen3"]
    with pytest.raises(ValueError, match="unknown reasoning parser 'x' .*qwen3"):
        get_reasoning_parser("x")


@pytest.mark.parametrize(
    ("tail", "qwen3", "r1"),
    [
        ("<|im_start|>assistant\n", StartPhase.OPTIONAL, StartPhase.THINKING),
        ("<|im_start|>assistant\n<think>\n", StartPhase.THINKING, StartPhase.THINKING),
        ("assistant\n<think>\n\n</think>\n\n", StartPhase.ANSWER, StartPhase.ANSWER),
        # Closed thinking of an earlier turn does not count.
        ("<think>x</think>done<|im_end|>\n<|im_start|>assistant\n", StartPhase.OPTIONAL,
         StartPhase.THINKING),
    ],
)  # fmt: skip
def test_where_the_output_starts(tail: str, qwen3: StartPhase, r1: StartPhase) -> None:
    assert QWEN3.start_phase(tail) is qwen3
    assert R1.start_phase(tail) is r1


def test_examples() -> None:
    text = "<think>\nThe user greets me.\n</think>\n\nHello!"
    assert _split(QWEN3, text, StartPhase.OPTIONAL) == ("The user greets me.", "Hello!")
    assert _split(R1, text, StartPhase.THINKING) == ("The user greets me.", "Hello!")
    # DeepSeek-R1 after a prompt that opened the thinking: no start tag.
    assert _split(R1, "Hmm.</think>Yes.", StartPhase.THINKING) == ("Hmm.", "Yes.")
    # Qwen3 that did not think, or was told not to.
    assert _split(QWEN3, "Hello!", StartPhase.OPTIONAL) == ("", "Hello!")
    assert _split(QWEN3, "<think>x</think>y", StartPhase.ANSWER) == ("", "<think>x</think>y")
    # Cut by max_tokens inside the thinking: all of it is reasoning.
    assert _split(QWEN3, "<think>Let me", StartPhase.OPTIONAL) == ("Let me", "")
    # While streaming, a partial tag is held back.
    assert QWEN3.split("<thi", StartPhase.OPTIONAL, final=False) == ("", "")
    assert QWEN3.split("<think>a b</th", StartPhase.OPTIONAL, final=False) == ("a b", "")


@given(
    thinking=_TEXT,
    answer=_TEXT,
    opened=st.booleans(),
    closed=st.booleans(),
    lead=st.sampled_from(["", "\n", " \n "]),
)
@settings(max_examples=300, deadline=None)
def test_thinking_and_answer_come_apart(
    thinking: str, answer: str, opened: bool, closed: bool, lead: str
) -> None:
    text = lead + ("<think>" if opened else "") + thinking + ("</think>" + answer if closed else "")
    for parser, phase in ((R1, StartPhase.THINKING), (QWEN3, StartPhase.THINKING)):
        expected = (thinking.strip(), answer.lstrip() if closed else "")
        assert _split(parser, text, phase) == expected
        _assert_prefix_stable(parser, text, phase)
    # Optional thinking happens only when the output opens with the tag.
    if opened:
        assert _split(QWEN3, text, StartPhase.OPTIONAL) == _split(QWEN3, text, StartPhase.THINKING)
    elif not (thinking + answer).lstrip().startswith("<think>"):
        assert _split(QWEN3, text, StartPhase.OPTIONAL) == ("", text)
    _assert_prefix_stable(QWEN3, text, StartPhase.OPTIONAL)
    assert _split(QWEN3, text, StartPhase.ANSWER) == ("", text)


@given(
    text=st.lists(st.sampled_from(["<think>", "</think>", "<th", "</", "a", " ", "\n"])).map(
        "".join
    )
)
@settings(max_examples=300, deadline=None)
def test_no_text_breaks_prefix_stability(text: str) -> None:
    for phase in StartPhase:
        _assert_prefix_stable(QWEN3, text, phase)
        _assert_prefix_stable(R1, text, phase)
