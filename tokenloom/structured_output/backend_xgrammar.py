"""The xgrammar backend: checking constraints, compiling them, and matching tokens.

xgrammar (https://xgrammar.mlc.ai, the library vLLM and SGLang use) turns a
JSON schema, regex or EBNF grammar into a compiled grammar over the model's
vocabulary; a ``GrammarMatcher`` walks it token by token and fills a packed
bitmask (one bit per token id, 32 per int32 word) of the tokens allowed next.

xgrammar is imported lazily: engines that never see a structured request do
not pay for the import (a couple of seconds).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenloom.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly the given strings."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _ebnf_literal(text: str) -> str:
    out = ['"']
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The tokenizer-independent grammar of a constraint; raises on invalid input."""
    import xgrammar as xgr

    kind = params.kind
    if kind == "json":
        return xgr.Grammar.from_json_schema(
            params.schema_text(), any_whitespace=not params.disable_any_whitespace
        )
    if kind == "json_object":
        if params.disable_any_whitespace:
            return xgr.Grammar.from_json_schema(
                json.dumps({"type": "object"}), any_whitespace=False
            )
        return xgr.Grammar.builtin_json_grammar()
    if kind == "regex":
        assert params.regex is not None
        return xgr.Grammar.from_regex(params.regex)
    if kind == "choice":
        assert params.choice is not None
        return xgr.Grammar.from_ebnf(choice_grammar(params.choice))
    assert params.grammar is not None
    return xgr.Grammar.from_ebnf(params.grammar)


_PROBLEM = {
    "json": "is not a JSON schema that can be enforced",
    "regex": "is not a valid regular expression",
    "grammar": "is not a valid EBNF grammar",
    "choice": "cannot be compiled",
    "json_object": "cannot be compiled",
}


def _clean(message: str) -> str:
    """xgrammar's C++ messages start with a timestamp and a source location."""
    text = message.strip().splitlines()[0] if message.strip() else message
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    if ".cc:" in text and ": " in text:
        text = text.split(": ", 1)[1]
    return text


def grammar_error(params: StructuredOutputsParams, exc: BaseException) -> ValueError:
    """The ValueError for a constraint the backend refused (names the field)."""
    kind = params.kind
    return ValueError(f"structured_outputs.{kind} {_PROBLEM[kind]}: {_clean(str(exc))}")


# Constraints already known to be valid (bounded, oldest forgotten first).
_VALIDATED: OrderedDict[tuple[str, str, bool], None] = OrderedDict()
_VALIDATED_MAX = 256
_VALIDATED_LOCK = threading.Lock()


def validate(params: StructuredOutputsParams) -> None:
    """Raise ``ValueError`` naming the field when the backend cannot enforce ``params``.

    Runs in the front end, before a request reaches the engine: it converts
    the constraint to a grammar without the tokenizer (milliseconds), which is
    where invalid schemas, regexes and grammars are found. A constraint seen
    valid before is not converted again.
    """
    key = params.cache_key()
    with _VALIDATED_LOCK:
        if key in _VALIDATED:
            _VALIDATED.move_to_end(key)
            return
    try:
        _grammar(params)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise grammar_error(params, exc) from exc
    with _VALIDATED_LOCK:
        _VALIDATED[key] = None
        if len(_VALIDATED) > _VALIDATED_MAX:
            _VALIDATED.popitem(last=False)


class XgrammarBackend:
    """Compiles constraints against one tokenizer; thread-safe (compiles run in a pool).

    ``tokenizer`` is a Hugging Face tokenizer, or an ``xgrammar.TokenizerInfo``
    already built (tests use small hand-made vocabularies).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        if isinstance(tokenizer, xgr.TokenizerInfo):
            self.tokenizer_info = tokenizer
        else:
            stops = list(stop_token_ids)
            # The engine also stops on the tokenizer's EOS (input processing adds it).
            eos = getattr(tokenizer, "eos_token_id", None)
            if isinstance(eos, int) and eos not in stops:
                stops.append(eos)
            self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=stops
            )
        # Our own cache (keyed by the constraint) is the one that counts; one
        # compiler thread per compile keeps the shared cores for the model.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Compile ``params``; raises ``ValueError`` naming the field when it cannot."""
        try:
            return self.compiler.compile_grammar(_grammar(params))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise grammar_error(params, exc) from exc

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> XgrammarMatcher:
        return XgrammarMatcher(compiled)


class XgrammarMatcher:
    """One request's position in its grammar.

    ``accept_tokens`` advances it by sampled tokens; ``validate_tokens`` says
    how many draft tokens the grammar allows without moving; ``fill_bitmask``
    writes the allowed next tokens into a row of a packed bitmask.
    """

    __slots__ = ("_matcher", "num_processed_tokens")

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self.num_processed_tokens = 0

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance by ``token_ids``; False (and stop) at the first token refused."""
        matcher = self._matcher
        for token in token_ids:
            if not matcher.accept_token(token):
                return False
            self.num_processed_tokens += 1
        return True

    def validate_tokens(self, token_ids: Sequence[int]) -> list[int]:
        """The longest prefix of ``token_ids`` the grammar accepts; the state is unchanged."""
        matcher = self._matcher
        accepted: list[int] = []
        for token in token_ids:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            accepted.append(token)
        if accepted:
            matcher.rollback(len(accepted))
        return accepted

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)
            self.num_processed_tokens -= num_tokens

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def reset(self) -> None:
        self._matcher.reset()
        self.num_processed_tokens = 0
