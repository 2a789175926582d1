"""A chat completion's output as the client sees it: reasoning, content and tool calls.

The generated text goes through the reasoning parser (``--reasoning-parser``:
the thinking becomes ``reasoning_content``), then the answer through the
request's tool parser and checker (``tool_parsers/checked.py``: only calls
that hold up). ``ReplyParser.view`` is the same function for a whole
response and for each step of a stream (``ReplyStream``): every view of a
prefix is a prefix of the final one, so streamed deltas add up to exactly
the non-streamed message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenloom.reasoning import ReasoningParser, StartPhase

from .tool_parsers import CheckedCall, ToolCallChecker, ToolParser, settle


@dataclass
class ReplyView:
    """The reply so far: ``""`` is an empty field."""

    reasoning: str = ""
    content: str = ""
    calls: list[CheckedCall] = field(default_factory=list)


@dataclass
class ReplyDelta:
    reasoning: str = ""
    content: str = ""
    # (index, call): each call whole, once it is accepted.
    calls: list[tuple[int, CheckedCall]] = field(default_factory=list)


class ReplyParser:
    """One request's way from text to reply: the reasoning split, then its tool calls.

    ``phase`` is where the output starts relative to the thinking (from the
    end of the prompt). Without a tool parser the content is the answer as
    written; with one, it is stripped.
    """

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        phase: StartPhase,
        tools: ToolParser | None,
        checker: ToolCallChecker | None,
    ) -> None:
        self.reasoning = reasoning
        self.phase = phase
        self.tools = tools
        self.checker = checker

    def view(self, text: str, final: bool) -> ReplyView:
        if self.reasoning is None:
            reasoning, content = "", text
        else:
            reasoning, content = self.reasoning.split(text, self.phase, final)
        if self.tools is None or self.checker is None:
            return ReplyView(reasoning, content)
        settled = settle(self.tools, self.checker, content, final)
        return ReplyView(reasoning, settled.content, settled.calls)


class ReplyStream:
    """One streamed choice: text deltas in, reply deltas out."""

    def __init__(self, parser: ReplyParser) -> None:
        self.parser = parser
        self.text = ""
        self._sent = ReplyView()

    @property
    def num_calls(self) -> int:
        return len(self._sent.calls)

    def feed(self, text_delta: str, *, finished: bool) -> ReplyDelta:
        self.text += text_delta
        view = self.parser.view(self.text, finished)
        sent = self._sent
        delta = ReplyDelta(
            reasoning=view.reasoning[len(sent.reasoning) :],
            content=view.content[len(sent.content) :],
            calls=list(enumerate(view.calls))[len(sent.calls) :],
        )
        self._sent = ReplyView(
            _longer(sent.reasoning, view.reasoning),
            _longer(sent.content, view.content),
            view.calls if len(view.calls) > len(sent.calls) else sent.calls,
        )
        return delta


def _longer(sent: str, now: str) -> str:
    return now if len(now) > len(sent) else sent
