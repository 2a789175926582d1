"""Incremental detokenization and stop strings, with the default model's tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from tokenloom.engine.detokenizer import IncrementalDetokenizer

PROMPT = [1, 9690, 198]  # "<|im_start|>system\n"


def stream(
    tokenizer: Any, token_ids: list[int], **kwargs: Any
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed one token at a time; return the detokenizer and the visible text after each."""
    detok = IncrementalDetokenizer(tokenizer, PROMPT, **kwargs)
    seen = []
    for token in token_ids:
        if detok.update([token]) is not None:
            break
        seen.append(detok.visible_text(finished=False))
    return detok, seen


@pytest.mark.parametrize(
    "text",
    ["héllo wörld", "emoji 😀 and 🎉🎉 here", "中文字符 and 日本語", "mixed: ünïcödé 🚀 世界!"],
)
def test_multibyte_text_matches_full_decode_and_never_shows_partial_chars(
    tokenizer: Any, text: str
) -> None:
    ids = tokenizer.encode(text)
    detok, seen = stream(tokenizer, ids)
    assert detok.output_text == tokenizer.decode(ids) == text
    for visible in seen:
        assert "\ufffd" not in visible
        assert text.startswith(visible)


def test_emoji_split_over_byte_tokens_appears_whole(tokenizer: Any) -> None:
    ids = tokenizer.encode(" 😀")
    assert len(ids) >= 2, "the emoji must span tokens for this test to mean anything"
    detok, seen = stream(tokenizer, ids)
    assert seen[:-1] == [""] * (len(ids) - 1)
    assert seen[-1] == " 😀"


def test_skip_special_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hi<|im_end|> there")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    skipped, _ = stream(tokenizer, ids, skip_special_tokens=True)
    kept, _ = stream(tokenizer, ids, skip_special_tokens=False)
    assert skipped.output_text == "Hi there"
    assert kept.output_text == "Hi<|im_end|> there"


def test_stop_string_spanning_tokens_is_cut_before(tokenizer: Any) -> None:
    ids = tokenizer.encode("The answer is forty two. More text")
    stop = "forty two"
    assert not any(stop in tokenizer.decode([t]) for t in ids), "stop must span tokens"
    detok, seen = stream(tokenizer, ids, stop=[stop])
    assert detok.stop_string == stop
    assert detok.output_text == "The answer is "
    assert all("forty" not in s for s in seen)


def test_include_stop_str_in_output(tokenizer: Any) -> None:
    ids = tokenizer.encode("The answer is forty two. More text")
    detok, _ = stream(tokenizer, ids, stop=["forty two"], include_stop_str_in_output=True)
    assert detok.output_text == "The answer is forty two"


def test_earliest_of_several_stop_strings_wins(tokenizer: Any) -> None:
    ids = tokenizer.encode("alpha beta gamma delta")
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=["delta", "beta"])
    assert detok.update(ids) == "beta"
    assert detok.output_text == "alpha "


def test_streaming_holds_back_possible_stop_prefix(tokenizer: Any) -> None:
    ids = tokenizer.encode("one two three STOP four")
    detok, seen = stream(tokenizer, ids, stop=["STOP"])
    assert detok.output_text == "one two three "
    # While streaming, the last len("STOP") - 1 characters were never visible.
    for visible, full in zip(seen, _prefix_texts(tokenizer, ids), strict=False):
        assert len(visible) <= max(len(full) - 3, 0)
        assert "ST" not in visible
    assert detok.visible_text(finished=True) == "one two three "


def test_no_hold_back_without_stop_strings(tokenizer: Any) -> None:
    ids = tokenizer.encode("one two three")
    detok, seen = stream(tokenizer, ids)
    assert detok.hold_back == 0
    assert seen[-1] == "one two three"


def test_min_tokens_defers_stop_strings(tokenizer: Any) -> None:
    ids = tokenizer.encode("stop here, then stop again")
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=["stop"], min_tokens=3)
    assert detok.update(ids) == "stop"
    assert detok.output_text == "stop here, then "


def _prefix_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    return [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]


class _DecodeOnly:
    """A tokenizer without a Rust backend: only ``decode``, like a slow tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.decode = tokenizer.decode


@pytest.mark.parametrize("skip", [True, False])
def test_tokenizer_without_backend_gives_same_text(tokenizer: Any, skip: bool) -> None:
    ids = tokenizer.encode("emoji 😀 中文<|im_end|> end")
    fast, fast_seen = stream(tokenizer, ids, skip_special_tokens=skip)
    slow, slow_seen = stream(_DecodeOnly(tokenizer), ids, skip_special_tokens=skip)  # type: ignore[arg-type]
    assert slow.output_text == fast.output_text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert slow_seen == fast_seen
