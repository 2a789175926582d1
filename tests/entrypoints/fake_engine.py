"""A model-free stand-in for AsyncLLM, so the HTTP layer can be tested in milliseconds.

The tokenizer maps each character to its code point. The engine "generates"
the prompt's last character's successors (a, b, c, ...), one per step, and
reports logprobs that make the sampled token the most likely one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from tokenloom.engine.exceptions import EngineDeadError
from tokenloom.outputs import CompletionOutput, RequestOutput
from tokenloom.sampling_params import SamplingParams


class CharTokenizer:
    chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tokenize: bool = False,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        for message in conversation:
            if message["role"] not in ("system", "user", "assistant"):
                raise ValueError(f"unknown role {message['role']}")
        text = "".join(f"{m['role']}: {m['content']}\n" for m in conversation)
        return text + ("assistant:" if add_generation_prompt else "")


class FakeAsyncLLM:
    model_name = "fake-model"
    max_model_len = 64

    def __init__(self, step_delay: float = 0.0) -> None:
        self.tokenizer = CharTokenizer()
        self.step_delay = step_delay
        self.errored = False
        self.num_waiting_requests = 0
        self.num_running_requests = 0
        self.started: list[str] = []
        self.closed: list[str] = []
        self.finished: list[str] = []
        self.params: list[SamplingParams] = []
        self.prompts: list[list[int]] = []

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError()

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        delta: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        if self.errored:
            raise EngineDeadError()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens, longer than {self.max_model_len}")
        self.started.append(request_id)
        self.prompts.append(ids)
        self.params.append(sampling_params)
        self.num_running_requests += 1
        max_tokens = sampling_params.max_tokens or 8
        texts = [""] * sampling_params.n
        tokens: list[list[int]] = [[] for _ in range(sampling_params.n)]
        history: list[list[dict[int, float]]] = [[] for _ in range(sampling_params.n)]
        try:
            for step in range(max_tokens):
                if self.step_delay:
                    await asyncio.sleep(self.step_delay)
                if self.errored:
                    raise EngineDeadError()
                outputs = []
                last = step == max_tokens - 1
                for index in range(sampling_params.n):
                    token = ord("a") + (index + step) % 26
                    tokens[index].append(token)
                    texts[index] += chr(token)
                    logprobs = None
                    if sampling_params.logprobs is not None:
                        top = {token: -0.5, token + 1: -1.5, token + 2: -2.5}
                        history[index].append(
                            dict(list(top.items())[: 1 + sampling_params.logprobs])
                        )
                        logprobs = history[index][-1:] if delta else list(history[index])
                    outputs.append(
                        CompletionOutput(
                            index=index,
                            text=chr(token) if delta else texts[index],
                            token_ids=[token] if delta else list(tokens[index]),
                            finish_reason="length" if last else None,
                            logprobs=logprobs,
                        )
                    )
                yield RequestOutput(
                    request_id=request_id,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=ids,
                    outputs=outputs,
                    finished=last,
                )
            self.finished.append(request_id)
        finally:
            self.num_running_requests -= 1
            self.closed.append(request_id)
