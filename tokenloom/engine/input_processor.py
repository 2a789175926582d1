"""Prompts in, validated ``EngineCoreRequest``s out.

Runs in the front end, before anything reaches the engine core, so a bad
request is refused with a ``ValueError`` naming the problem and never disturbs
the requests already running.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from tokenloom.engine.messages import EngineCoreRequest
from tokenloom.sampling_params import SamplingParams

PromptType = str | list[int]


class InputProcessor:
    """Tokenizes and validates prompts against the model's context and vocabulary.

    ``eos_token_ids[0]`` becomes the request's EOS token; the others are added
    to its stop token ids unless it ignores EOS.
    """

    def __init__(
        self, tokenizer: Any, max_model_len: int, vocab_size: int, eos_token_ids: list[int]
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Return ``(prompt text or None, prompt token ids)``."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ValueError("prompt token ids must be a list of integers")
            return None, list(prompt)
        raise ValueError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
        )

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        prompt_text: str | None = None,
    ) -> tuple[str | None, list[EngineCoreRequest]]:
        """Validate one prompt; return its text and one core request per completion (``n``).

        ``prompt_text`` names the text of a prompt given as token ids (a rendered chat).
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        text, token_ids = self.tokenize(prompt)
        text = text if prompt_text is None else prompt_text
        self._validate(token_ids, params)
        core_params = self._with_eos_stops(params)
        arrival = time.time() if arrival_time is None else arrival_time
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        if params.n == 1:
            children = [(request_id, core_params)]
        else:
            children = [
                (f"{i}_{request_id}", _child_params(core_params, i)) for i in range(params.n)
            ]
        return text, [
            EngineCoreRequest(
                request_id=child_id,
                prompt_token_ids=token_ids,
                sampling_params=child_params,
                eos_token_id=eos,
                arrival_time=arrival,
                priority=priority,
            )
            for child_id, child_params in children
        ]

    def render_chat(self, conversation: object) -> tuple[str, list[int]]:
        """Apply the chat template (with the assistant turn opened) to one conversation."""
        if not isinstance(conversation, list) or not conversation:
            raise ValueError("a conversation must be a non-empty list of messages")
        for message in conversation:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError('each chat message must be a dict with a string "role"')
            if not isinstance(message.get("content"), str):
                raise ValueError('each chat message must have a string "content"')
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template")
        text = self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
        # The template already wrote any BOS/special tokens as text.
        return text, list(self.tokenizer.encode(text, add_special_tokens=False))

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        num = len(token_ids)
        if num >= self.max_model_len:
            raise ValueError(
                f"prompt is {num} tokens, which leaves no room to generate within the "
                f"maximum context length of {self.max_model_len} tokens"
            )
        if params.max_tokens is not None and num + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({num} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"maximum context length of {self.max_model_len} tokens"
            )
        if params.stop_token_ids and any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {self.vocab_size}")

    def _with_eos_stops(self, params: SamplingParams) -> SamplingParams:
        extra = self.eos_token_ids[1:]
        if params.ignore_eos or not extra:
            return params
        stops = list(params.stop_token_ids or [])
        stops += [t for t in extra if t not in stops]
        return dataclasses.replace(params, stop_token_ids=stops)


def eos_token_ids(arch_eos_ids: list[int], tokenizer: Any) -> list[int]:
    """The model's EOS ids (the checkpoint's first), then the tokenizer's if it differs."""
    ids = list(arch_eos_ids)
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tokenizer_eos, int) and tokenizer_eos not in ids:
        ids.append(tokenizer_eos)
    return ids


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion ``index`` of ``n``: n=1, and a distinct seed so seeded children differ."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)
