"""Where a reasoning model's thinking ends and its answer begins (``--reasoning-parser``).

Reasoning models write their thinking between tags (``<think> ... </think>``)
and the answer after it. A ``ReasoningParser`` splits generated text into
``(reasoning, content)``, and says, from the end of the prompt, how the
output starts (``StartPhase``): the chat template may already have opened the
thinking (DeepSeek-R1's, Qwen3-Thinking's), closed it (Qwen3's with
``enable_thinking: false``), or left it to the model.

``split(text, phase, final)`` is written once for whole and streamed
responses: with ``final=False`` the text is a prefix of the output and the
split holds back what may still change (a partial tag, trailing
whitespace), so each view is a prefix of the final one and streamed deltas
add up to exactly the non-streamed fields.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Prompt tokens decoded to find how the prompt ends: enough for a closed
# ``<think>\n\n</think>\n\n`` whatever the tokenizer.
_TAIL_TOKENS = 16


class StartPhase(enum.Enum):
    """Where the output begins."""

    THINKING = "thinking"  # inside the thinking: the answer comes after the end tag
    OPTIONAL = "optional"  # the model thinks only if its output opens with the start tag
    ANSWER = "answer"  # no thinking: the prompt closed it


@dataclass(frozen=True)
class ReasoningParser:
    """A ``<think>``-style format: ``start_tag`` ... ``end_tag``, then the answer.

    ``default_phase`` is how the output starts when the prompt neither opened
    nor closed the thinking.
    """

    name: str
    default_phase: StartPhase
    start_tag: str = "<think>"
    end_tag: str = "</think>"

    def start_phase(self, prompt_tail: str) -> StartPhase:
        """How the output after a prompt ending with ``prompt_tail`` starts.

        Only the end of the prompt counts: earlier turns may hold closed
        thinking of their own.
        """
        tail = prompt_tail.rstrip()
        if tail.endswith(self.end_tag):
            return StartPhase.ANSWER
        if tail.endswith(self.start_tag):
            return StartPhase.THINKING
        return self.default_phase

    def prompt_phase(self, tokenizer: Any, prompt_token_ids: Sequence[int]) -> StartPhase:
        """``start_phase`` of a tokenized prompt (``tokenizer`` decodes its end)."""
        tail = tokenizer.decode(list(prompt_token_ids[-_TAIL_TOKENS:]), skip_special_tokens=False)
        return self.start_phase(str(tail))

    def split(self, text: str, phase: StartPhase, final: bool) -> tuple[str, str]:
        """``(reasoning, content)`` of the output ``text`` (so far, unless ``final``).

        The reasoning is stripped; the content loses its leading whitespace.
        An output cut inside the thinking is all reasoning.
        """
        if phase is StartPhase.ANSWER:
            return "", text
        stripped = text.lstrip()
        opened = stripped.startswith(self.start_tag)
        if not opened and not final and stripped and self.start_tag.startswith(stripped):
            return "", ""  # a start tag may be arriving: nothing is known yet
        if phase is StartPhase.OPTIONAL and not opened:
            if not final and not stripped:
                return "", ""
            return "", text
        body = stripped[len(self.start_tag) :] if opened else text
        end = body.find(self.end_tag)
        if end >= 0:
            return body[:end].strip(), body[end + len(self.end_tag) :].lstrip()
        if final:
            return body.strip(), ""
        # Trailing whitespace may yet turn out to end the reasoning: hold it back.
        return body[: held_back_end(body, self.end_tag)].strip(), ""


def held_back_end(text: str, tag: str) -> int:
    """Where to cut ``text`` so that no partial ``tag`` at its end is shown."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return len(text) - size
    return len(text)
