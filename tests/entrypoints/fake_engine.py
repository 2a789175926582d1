"""A model-free ``EngineClient``, so the HTTP layer can be tested in milliseconds.

The tokenizer maps each character to its code point. The engine "generates"
the successors of "a" (a, b, c, ...), one per step, and reports logprobs that
make the sampled token the most likely one; with ``reply`` set it writes that
text instead, one character per step, and stops (``finish_reason`` stop, or
length when ``max_tokens`` cuts the reply short). Requests are validated the way
AsyncLLM validates them (vocabulary, context length, --max-logprobs), with
ValueErrors that start with the field's name, and chats are rendered with a
real Jinja template. With ``pooler_config`` set it is a pooling engine
instead: ``encode`` answers each prompt with a small vector made from its
token ids, completed and checked by the real ``PoolerConfig`` and truncated
or refused over the context as the real engine does.
"""

from __future__ import annotations

import array
import asyncio
import math
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenloom.engine.exceptions import EngineDeadError
from tokenloom.engine.protocol import ChatOptions, RenderedChat
from tokenloom.lora_request import LoRARequest
from tokenloom.metrics.stats import StatLogger
from tokenloom.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from tokenloom.pooling.config import PoolerConfig
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams

VOCAB_SIZE = 0x110000
DEFAULT_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class CharTokenizer:
    chat_template = DEFAULT_TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        # Surrogate code points decode to U+FFFD, as a byte-level decoder would.
        return "".join("\ufffd" if 0xD800 <= i < 0xE000 else chr(i) for i in ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.decode([i]) for i in ids]

    def __len__(self) -> int:
        return VOCAB_SIZE


class FakeAsyncLLM:
    model_name = "fake-model"
    max_model_len = 64
    data_parallel_size = 1
    max_logprobs = 20

    def __init__(self, step_delay: float = 0.0, pooler_config: PoolerConfig | None = None) -> None:
        self.pooler_config = pooler_config
        self.pooling_params: list[PoolingParams] = []
        self.tokenizer = CharTokenizer()
        self.stat_loggers: list[StatLogger] = []
        self.step_delay = step_delay
        self.errored = False
        self.restarting = False  # the real engine's degraded state (crash recovery)
        self.num_waiting_requests = 0
        self.num_running_requests = 0
        self.started: list[str] = []
        self.closed: list[str] = []
        self.finished: list[str] = []
        self.aborted: list[str] = []
        self.params: list[SamplingParams] = []
        self.prompts: list[list[int]] = []
        self.rendered: list[RenderedChat] = []
        self.conversations: list[list[dict[str, Any]]] = []
        self.chat_options: list[ChatOptions] = []
        self.loras: list[LoRARequest | None] = []  # per started request
        self.trace_headers: list[dict[str, str] | None] = []  # per generate() call
        self.tenants: list[tuple[str, float]] = []  # per started request
        self.added_loras: list[LoRARequest] = []
        self.removed_loras: list[int] = []
        self._jinja = ImmutableSandboxedEnvironment()
        self.reply: str | None = None
        # While set and not yet fired, requests wait (queued) before their first output.
        self.hold: asyncio.Event | None = None
        # What a KV connector would return on a finished request's output.
        self.kv_transfer_params: dict[str, Any] | None = None

    @property
    def dead_error(self) -> EngineDeadError:
        return EngineDeadError()

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError()

    async def render_chat(
        self, messages: list[dict[str, Any]], options: ChatOptions
    ) -> RenderedChat:
        if self.errored:
            raise EngineDeadError()
        source = options.chat_template or self.tokenizer.chat_template
        try:
            template = self._jinja.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat_template is not a valid template: {exc}") from exc
        reserved = {"messages", "add_generation_prompt"} & set(options.chat_template_kwargs)
        if reserved:
            raise ValueError(f"chat_template_kwargs must not set {sorted(reserved)}")
        try:
            text = template.render(
                messages=messages,
                add_generation_prompt=options.add_generation_prompt,
                **options.chat_template_kwargs,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"messages could not be rendered: {exc}") from exc
        rendered = RenderedChat(text, self.tokenizer.encode(text))
        self.rendered.append(rendered)
        self.conversations.append(messages)
        self.chat_options.append(options)
        return rendered

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Accepts any existing directory, as a stand-in for the real checks."""
        if not Path(lora_request.lora_path).is_dir():
            raise ValueError(f"LoRA adapter path {lora_request.lora_path} is not a directory")
        self.added_loras.append(lora_request)

    async def remove_lora(self, lora_int_id: int) -> None:
        self.removed_loras.append(lora_int_id)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        self.aborted += [request_id] if isinstance(request_id, str) else list(request_id)

    def shutdown(self) -> None:
        pass

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("prompt must not be empty")
        bad = next((t for t in ids if not 0 <= t < VOCAB_SIZE), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {VOCAB_SIZE})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens, longer than {self.max_model_len}")
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt + max_tokens exceeds {self.max_model_len} tokens")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(f"logprobs must be at most {self.max_logprobs} (--max-logprobs)")
        if params.structured_outputs is not None:
            from tokenloom.structured_output.backend_xgrammar import validate

            validate(params.structured_outputs)

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        delta: bool = False,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        tenant: str = "",
        tenant_weight: float = 1.0,
    ) -> AsyncIterator[RequestOutput]:
        if self.errored:
            raise EngineDeadError()
        self.trace_headers.append(dict(trace_headers) if trace_headers else None)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate(ids, sampling_params)
        self.started.append(request_id)
        self.loras.append(lora_request)
        self.tenants.append((tenant, tenant_weight))
        self.prompts.append(ids)
        self.params.append(sampling_params)
        self.num_running_requests += 1
        max_tokens = sampling_params.max_tokens or self.max_model_len - len(ids)
        reply = self.reply
        # Finished by itself (the reply's end) or cut (max_tokens).
        end_reason = "length"
        if reply is not None and len(reply) <= max_tokens:
            max_tokens, end_reason = len(reply), "stop"
        texts = [""] * sampling_params.n
        tokens: list[list[int]] = [[] for _ in range(sampling_params.n)]
        history: list[list[dict[int, float]]] = [[] for _ in range(sampling_params.n)]
        try:
            if self.hold is not None:
                await self.hold.wait()
            for step in range(max_tokens):
                if self.step_delay:
                    await asyncio.sleep(self.step_delay)
                if self.errored:
                    raise EngineDeadError()
                outputs = []
                last = step == max_tokens - 1
                for index in range(sampling_params.n):
                    token = ord("a") + (index + step) % 26 if reply is None else ord(reply[step])
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
                            finish_reason=end_reason if last else None,
                            logprobs=logprobs,
                        )
                    )
                yield RequestOutput(
                    request_id=request_id,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=ids,
                    outputs=outputs,
                    finished=last,
                    kv_transfer_params=self.kv_transfer_params if last else None,
                )
            self.finished.append(request_id)
        finally:
            self.num_running_requests -= 1
            self.closed.append(request_id)

    async def encode(
        self,
        prompt: str | list[int],
        pooling_params: PoolingParams | None,
        request_id: str,
        *,
        priority: int = 0,
        tenant: str = "",
        tenant_weight: float = 1.0,
    ) -> AsyncIterator[PoolingRequestOutput[PoolingOutput]]:
        """A vector of 4 values from the token ids (its first ``dimensions``), normalised
        unless asked not to be."""
        if self.errored:
            raise EngineDeadError()
        if self.pooler_config is None:
            raise ValueError("model: this engine generates text; it cannot embed")
        params = self.pooler_config.request_params(pooling_params, self.model_name)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        truncate = params.truncate_prompt_tokens
        if truncate is not None:
            keep = self.max_model_len if truncate == -1 else truncate
            if keep > self.max_model_len:
                raise ValueError(f"truncate_prompt_tokens ({truncate}) exceeds the context")
            ids = ids[-keep:]
        if not ids:
            raise ValueError("prompt must not be empty")
        bad = next((t for t in ids if not 0 <= t < VOCAB_SIZE), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {VOCAB_SIZE})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens, longer than {self.max_model_len}")
        self.started.append(request_id)
        self.tenants.append((tenant, tenant_weight))
        self.prompts.append(ids)
        self.pooling_params.append(params)
        try:
            if self.step_delay:
                await asyncio.sleep(self.step_delay)
            if self.errored:
                raise EngineDeadError()
            vector = [float(len(ids)), float(sum(ids) % 97), 1.0, 2.0][: params.dimensions]
            if params.normalize:
                norm = math.sqrt(sum(v * v for v in vector))
                vector = [v / norm for v in vector]
            raw = array.array("f", vector).tobytes()
            yield PoolingRequestOutput(request_id, PoolingOutput(raw), ids)
            self.finished.append(request_id)
        finally:
            self.closed.append(request_id)
