"""Structured outputs of reasoning models: the grammar applies to the answer, not the thinking.

The front end (``--reasoning-parser``) sets ``StructuredOutputsParams.reasoning_gate``
on a structured request whose output may start with thinking. Until the
end-of-thinking token has been sampled, the request's grammar is neither
advanced nor applied (its tokens are free); the tokens after it must match
the grammar. With ``optional_start_token_id`` the model may skip thinking:
its first token is then either that start token (thinking follows) or the
answer's first token, so the first bitmask row allows the grammar's tokens
and the start token. ``ReasoningTokens`` makes the gate for a prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenloom.reasoning import ReasoningParser, StartPhase


@dataclass(frozen=True)
class ReasoningGate:
    """Where the grammar starts: after ``end_token_id`` (see the module docstring)."""

    end_token_id: int
    optional_start_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("end_token_id", "optional_start_token_id"):
            value = getattr(self, name)
            if value is None and name == "optional_start_token_id":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"structured_outputs.reasoning_gate.{name} must be a token id, got {value!r}"
                )


_THINKING, _UNDECIDED, _ANSWER = 0, 1, 2


class ReasoningPhase:
    """One request's place relative to its thinking: still thinking, not yet known, answering.

    Without a gate the request answers from its first token.
    """

    __slots__ = ("_gate", "_phase")

    def __init__(self, gate: ReasoningGate | None) -> None:
        self._gate = gate
        if gate is None:
            self._phase = _ANSWER
        elif gate.optional_start_token_id is None:
            self._phase = _THINKING
        else:
            self._phase = _UNDECIDED

    @property
    def answering(self) -> bool:
        """True once the grammar applies (the next sampled token is the answer's)."""
        return self._phase == _ANSWER

    @property
    def thinking(self) -> bool:
        """True while the next token is surely part of the thinking (no grammar row)."""
        return self._phase == _THINKING

    @property
    def also_allowed(self) -> int | None:
        """A token the next bitmask row allows besides the grammar's (the optional start)."""
        if self._phase == _UNDECIDED:
            assert self._gate is not None
            return self._gate.optional_start_token_id
        return None

    def answer_start(self, token_ids: Sequence[int], stop: int) -> int:
        """Move past the thinking in ``token_ids[:stop]`` (tokens just sampled, in order).

        Returns the index of the first token that belongs to the answer
        (``stop`` when they all belong to the thinking); from then on the
        request answers.
        """
        gate = self._gate
        i = 0
        while i < stop and self._phase != _ANSWER:
            assert gate is not None
            token = token_ids[i]
            if self._phase == _UNDECIDED:
                if token != gate.optional_start_token_id:
                    self._phase = _ANSWER
                    return i
                self._phase = _THINKING
            elif token == gate.end_token_id:
                self._phase = _ANSWER
            i += 1
        return i

    def draft_limit(self, drafts: list[int]) -> list[int]:
        """The drafts that may be verified before the grammar could apply to them.

        While thinking, drafts stop before the end token, so that the
        grammar never starts in the middle of a step's sampled positions (its
        rows there would be missing); undecided, none are kept.
        """
        if self._phase == _ANSWER:
            return drafts
        if self._phase == _UNDECIDED:
            return []
        assert self._gate is not None
        end = self._gate.end_token_id
        return drafts[: drafts.index(end)] if end in drafts else drafts


@dataclass(frozen=True)
class ReasoningTokens:
    """``parser``'s start and end tags, each one token of the model's vocabulary."""

    parser: ReasoningParser
    start_token_id: int
    end_token_id: int

    @classmethod
    def resolve(cls, parser: ReasoningParser, tokenizer: Any, vocab_size: int) -> ReasoningTokens:
        """Raises ``ValueError`` naming ``reasoning_parser`` when a tag is not one token
        of the model's ``vocab_size`` (the model is not the reasoning model the
        parser is for)."""
        ids = []
        for tag in (parser.start_tag, parser.end_tag):
            encoded = list(tokenizer.encode(tag, add_special_tokens=False))
            if len(encoded) != 1 or not 0 <= encoded[0] < vocab_size:
                raise ValueError(
                    f"reasoning_parser {parser.name!r} needs {tag!r} to be one token of the "
                    f"model's vocabulary, but it encodes to {encoded[:8]}: this model is not "
                    "a reasoning model of that family"
                )
            ids.append(encoded[0])
        return cls(parser, ids[0], ids[1])

    def gate(self, tokenizer: Any, prompt_token_ids: list[int]) -> ReasoningGate | None:
        """Where a structured request's grammar starts after this prompt (None: at once)."""
        phase = self.parser.prompt_phase(tokenizer, prompt_token_ids)
        if phase is StartPhase.ANSWER:
            return None
        if phase is StartPhase.OPTIONAL:
            return ReasoningGate(self.end_token_id, self.start_token_id)
        return ReasoningGate(self.end_token_id)
