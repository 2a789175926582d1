"""Reasoning models: splitting thinking from the answer, and where a grammar may start.

``get_reasoning_parser(name)`` gives the parser ``--reasoning-parser`` names
(vLLM's names): ``qwen3`` (Qwen3; thinking only when the output opens with
``<think>``, none after a prompt that closed it, as ``enable_thinking:
false`` does) and ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ: the
output starts inside the thinking, with or without ``<think>``).
For the engine's side (a structured request's grammar applies after the
end tag's token), see ``structured_output/reasoning_gate.py``. Pure text:
imports nothing else of tokenloom.
"""

from __future__ import annotations

from tokenloom.reasoning.parser import ReasoningParser, StartPhase

_PARSERS = {
    parser.name: parser
    for parser in (
        ReasoningParser("qwen3", StartPhase.OPTIONAL),
        ReasoningParser("deepseek_r1", StartPhase.THINKING),
    )
}


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered as ``name``; ``ValueError`` listing the known ones."""
    try:
        return _PARSERS[name]
    except KeyError:
        known = ", ".join(reasoning_parser_names())
        raise ValueError(f"unknown reasoning parser {name!r} (known: {known})") from None


__all__ = [
    "ReasoningParser",
    "StartPhase",
    "get_reasoning_parser",
    "reasoning_parser_names",
]
