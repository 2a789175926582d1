"""Incremental detokenization and stop strings for one sequence.

Text is produced by decoding a small window of recent tokens twice, with and
without the newest ones, and keeping the difference. While the window ends in
an unfinished UTF-8 sequence (the decoder yields U+FFFD) nothing is emitted,
so a character split over several byte tokens (emoji, CJK) appears whole.
Starting the window inside the prompt keeps tokenizers that drop a leading
space (SentencePiece) from losing it on the first generated token.

Stop strings are searched in the text the newest tokens added plus the tail
before it, so a stop string spanning tokens is found. While streaming, the
last ``len(longest stop) - 1`` characters are held back: they might be the
start of a stop string that must not reach the client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Tokens of context the decode window keeps behind the text already emitted.
_PREFIX_WINDOW = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated token ids into text, a few at a time.

    ``output_text`` is the text so far (already cut at a stop string);
    ``stop_string`` is the stop string that ended it, if any.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        # A fast tokenizer's Rust backend decodes the same text without
        # transformers' per-call argument handling, which costs more than the decode.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._skip_special_tokens = skip_special_tokens
        self._stop = list(stop or ())
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        longest = max((len(s) for s in self._stop), default=0)
        self._max_stop_len = longest
        # Text that could still become a stop string is not streamed yet.
        self.hold_back = 0 if include_stop_str_in_output else max(longest - 1, 0)

        context = list(prompt_token_ids[-_PREFIX_WINDOW:])
        self._tokens = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_generated = 0
        self.output_text = ""
        self.stop_string: str | None = None

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; return the stop string if one now ends the text."""
        for token_id in new_token_ids:
            self._num_generated += 1
            added = self._decode_next(token_id)
            if not added:
                continue
            self.output_text += added
            if self._stop and self._num_generated > self._min_tokens:
                if self._check_stop(len(added)):
                    return self.stop_string
        return None

    def visible_text(self, finished: bool) -> str:
        """The text a client may see now: all of it once finished, else minus the hold-back."""
        if finished or not self.hold_back:
            return self.output_text
        return self.output_text[: max(len(self.output_text) - self.hold_back, 0)]

    def _decode_next(self, token_id: int) -> str:
        self._tokens.append(token_id)
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            # An unfinished multi-byte character, or a token with no text (a skipped
            # special token): wait for more tokens.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        # Keep the list short: only the window from prefix_offset on is ever decoded.
        if self._prefix_offset > 4 * _PREFIX_WINDOW:
            del self._tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return full_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        text = self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        return cast(str, text)  # one sequence in, one string out

    def _check_stop(self, num_new_chars: int) -> bool:
        """Search the new text and the tail that a stop string could span; cut on a hit."""
        text = self.output_text
        start = max(len(text) - num_new_chars - self._max_stop_len + 1, 0)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        self.output_text = text[: index + len(stop)] if self._include_stop else text[:index]
        self.stop_string = stop
        return True
