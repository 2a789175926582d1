"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests keep OpenAI's field names plus the vLLM extensions users rely on
(top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, ...). Range
checks are left to ``SamplingParams`` so that the server and the offline API
reject the same values with the same messages; pydantic only checks types.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)

from tokenloom.engine.protocol import ChatOptions
from tokenloom.sampling_params import SamplingParams
from tokenloom.structured_output import StructuredOutputsParams

from .errors import OpenAIError
from .tools import (
    ChatCompletionToolsParam,
    DeltaToolCall,
    ToolCall,
    ToolChoice,
    tool_choice_constraint,
)

# ---------------------------------------------------------------- requests


# OpenAI's limits, which vLLM follows too.
MAX_N = 128
MAX_CHAT_TOP_LOGPROBS = 20
# Each completion is an engine request: a batch of a million one-character
# prompts would otherwise queue a million of them.
MAX_SEQUENCES_PER_REQUEST = 2048
# Every generated token is checked against every stop string (on the event
# loop) and stop token id (in the engine step), so their number is bounded.
MAX_STOP_STRINGS = 128
MAX_STOP_TOKEN_IDS = 1024

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _documented(default: Any = None, **bounds: Any) -> Any:
    """A field whose allowed range is published in the schema but checked by
    ``SamplingParams``, so the server and the offline API share one message."""
    return Field(default, json_schema_extra=bounds)


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaResponseFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: the schema the reply must follow."""

    model_config = ConfigDict(populate_by_name=True)

    name: str
    description: str | None = None
    # ``schema`` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``text`` (no constraint), ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaResponseFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs`` request field: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    model_config = ConfigDict(populate_by_name=True)

    def to_params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(
            json=self.json_,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            json_object=bool(self.json_object),
            disable_any_whitespace=self.disable_any_whitespace,
        )


# Where a request's output constraint may come from, in the order they are checked.
_CONSTRAINT_SOURCES = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "tool_choice",
)


class _SamplingRequest(BaseModel):
    """Fields shared by the completions and chat endpoints."""

    # Unknown fields are ignored, as OpenAI clients send extras we do not use.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = _documented(1, minimum=1, maximum=MAX_N)
    temperature: float | None = _documented(minimum=0)
    top_p: float | None = _documented(exclusiveMinimum=0, maximum=1)
    top_k: int | None = _documented(minimum=-1, maximum=INT64_MAX)
    min_p: float | None = _documented(minimum=0, maximum=1)
    seed: int | None = _documented(minimum=INT64_MIN, maximum=2**64 - 1)
    presence_penalty: float | None = _documented(minimum=-2, maximum=2)
    frequency_penalty: float | None = _documented(minimum=-2, maximum=2)
    repetition_penalty: float | None = _documented(exclusiveMinimum=0)
    stop: str | list[str] | None = _documented(maxItems=MAX_STOP_STRINGS)
    stop_token_ids: list[int] | None = _documented(maxItems=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = _documented(0, minimum=0, maximum=INT64_MAX)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = _documented(0, minimum=INT64_MIN, maximum=INT64_MAX)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs,
    # and the older guided_* fields many clients still send. At most one.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's field: for a KV connector (prefill/decode disaggregation, docs/kv_connectors.md).
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _check_common(self) -> None:
        if self.logit_bias:
            raise OpenAIError("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        if self.n > MAX_N:
            raise OpenAIError(f"n must be at most {MAX_N}, got {self.n}", param="n")
        if not INT64_MIN <= self.priority <= INT64_MAX:
            raise OpenAIError("priority must be a 64-bit integer", param="priority")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise OpenAIError(f"stop may hold at most {MAX_STOP_STRINGS} strings", param="stop")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise OpenAIError(
                f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids", param="stop_token_ids"
            )

    def output_constraint(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's output constraint and the field it came from (None, None: none).

        Raises ``OpenAIError`` naming the field when it is malformed or when
        more than one field constrains the output.
        """
        found: list[tuple[str, StructuredOutputsParams]] = []
        for source in _CONSTRAINT_SOURCES:
            try:
                params = self._constraint_from(source)
            except ValueError as exc:
                raise OpenAIError(str(exc), param=source) from exc
            if params is not None:
                found.append((source, params))
        if not found:
            return None, None
        if len(found) > 1:
            names = " and ".join(source for source, _ in found)
            raise OpenAIError(
                f"only one field may constrain the output, got {names}", param=found[1][0]
            )
        source, params = found[0]
        return params, source

    def _constraint_from(self, source: str) -> StructuredOutputsParams | None:
        if source == "response_format":
            return _response_format_constraint(self.response_format)
        if source == "structured_outputs":
            return None if self.structured_outputs is None else self.structured_outputs.to_params()
        if source == "guided_json" and self.guided_json is not None:
            return StructuredOutputsParams(json=self.guided_json)
        if source == "guided_regex" and self.guided_regex is not None:
            return StructuredOutputsParams(regex=self.guided_regex)
        if source == "guided_choice" and self.guided_choice is not None:
            return StructuredOutputsParams(choice=self.guided_choice)
        if source == "guided_grammar" and self.guided_grammar is not None:
            return StructuredOutputsParams(grammar=self.guided_grammar)
        return None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Build SamplingParams; its ValueError (naming the field) propagates."""
        defaults = SamplingParams.__dataclass_fields__
        fields: dict[str, Any] = {}
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            fields[name] = defaults[name].default if value is None else value
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            n=self.n,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.output_constraint()[0],
            extra_args=(
                None
                if self.kv_transfer_params is None
                else {"kv_transfer_params": self.kv_transfer_params}
            ),
            **fields,
        )


def _response_format_constraint(fmt: ResponseFormat | None) -> StructuredOutputsParams | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise ValueError("response_format of type json_schema needs json_schema.schema")
    return StructuredOutputsParams(json=fmt.json_schema.json_schema)


def as_batch(
    value: str | list[str] | list[int] | list[list[int]], param: str
) -> list[str | list[int]]:
    """A prompt field (a text, texts, token ids, or token-id lists) as a non-empty list
    of prompts; an empty one is a 400 naming ``param``."""
    if isinstance(value, str):
        batch: list[Any] = [value]
    elif value and all(isinstance(t, int) for t in value):
        batch = [value]
    else:
        batch = list(value)
    if not batch:
        raise OpenAIError(f"{param} must not be empty", param=param)
    return batch


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. ``prompt`` may be text, token ids, or a batch of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = _documented(16, minimum=1, maximum=INT64_MAX)
    # Capped by the engine's --max-logprobs.
    logprobs: int | None = _documented(minimum=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a non-empty batch."""
        batch = as_batch(self.prompt, "prompt")
        if len(batch) * self.n > MAX_SEQUENCES_PER_REQUEST:
            raise OpenAIError(
                f"a request may ask for at most {MAX_SEQUENCES_PER_REQUEST} completions "
                f"(prompts x n), got {len(batch)} x {self.n}",
                param="prompt",
            )
        return batch

    def to_sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError("best_of must equal n (beam-like search is not supported)", "best_of")
        if self.echo and self.logprobs is not None:
            raise OpenAIError(
                "echo together with logprobs is not supported: prompt logprobs are not computed",
                param="echo",
            )
        return self._sampling_params(self.max_tokens, self.logprobs)


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings (OpenAI's shape, vLLM's extensions). ``input`` is a text, a
    list of texts, token ids, or a list of token-id lists; each item is one embedding."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    # Matryoshka models only; checked by the engine against the model.
    dimensions: int | None = _documented(minimum=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = _documented(minimum=-1)
    normalize: bool | None = None
    priority: int = _documented(0, minimum=INT64_MIN, maximum=INT64_MAX)

    def inputs(self) -> list[str | list[int]]:
        """The input as a non-empty batch of at most MAX_SEQUENCES_PER_REQUEST items."""
        batch = as_batch(self.input, "input")
        if len(batch) > MAX_SEQUENCES_PER_REQUEST:
            raise OpenAIError(
                f"input may hold at most {MAX_SEQUENCES_PER_REQUEST} items, got {len(batch)}",
                param="input",
            )
        return batch


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    """``url``: a ``data:image/...;base64,...`` URL, an http(s) URL, or (on a server
    started with ``--allowed-local-media-path``) a ``file:`` URL. ``detail`` is
    accepted and ignored, as vLLM does."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLContentPart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextContentPart | ImageURLContentPart, Field(discriminator="type")]

ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(BaseModel):
    """An input message: text, or text and image parts (for a vision-language model).

    Other keys (``tool_calls``, ``tool_call_id``, ...) are kept and reach the
    chat template, which decides what to make of them.
    """

    model_config = ConfigDict(extra="allow")

    role: ChatRole
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        content: Any = self.content
        if isinstance(content, list):
            if any(isinstance(part, ImageURLContentPart) for part in content):
                content = [part.model_dump(exclude_none=True) for part in content]
            else:
                content = "".join(part.text for part in content)  # type: ignore[union-attr]
        message: dict[str, Any] = dict(self.model_extra or {})
        message.update(role=self.role, content=content or "")
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatRenderFields(BaseModel):
    """How a conversation is rendered by the chat template (chat completions, /tokenize)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolsParam] | None = None

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template sees them (None: do not show tools)."""
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def chat_options(self) -> ChatOptions:
        return ChatOptions(
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template=self.chat_template,
            chat_template_kwargs=dict(self.chat_template_kwargs or {}),
            tools=self.tool_dicts(),
        )


class ChatCompletionRequest(_SamplingRequest, ChatRenderFields):
    """POST /v1/chat/completions. ``max_completion_tokens`` wins over ``max_tokens``."""

    max_tokens: int | None = _documented(minimum=1, maximum=INT64_MAX)
    max_completion_tokens: int | None = _documented(minimum=1, maximum=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = _documented(minimum=0, maximum=MAX_CHAT_TOP_LOGPROBS)
    # Default: "auto" with tools, "none" without.
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @property
    def max_tokens_param(self) -> str:
        """Which request field the token limit came from (for error messages)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def to_sampling_params(self) -> SamplingParams:
        self._check_common()
        if not self.messages:
            raise OpenAIError("messages must not be empty", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_CHAT_TOP_LOGPROBS:
            raise OpenAIError(
                f"top_logprobs must be in [0, {MAX_CHAT_TOP_LOGPROBS}], got {self.top_logprobs}",
                param="top_logprobs",
            )
        if self.add_generation_prompt and self.continue_final_message:
            raise OpenAIError(
                "add_generation_prompt and continue_final_message cannot both be true",
                param="continue_final_message",
            )
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)

    def _constraint_from(self, source: str) -> StructuredOutputsParams | None:
        if source == "tool_choice":
            return tool_choice_constraint(self.tools, self.tool_choice, self.parallel_tool_calls)
        return super()._constraint_from(source)

    @property
    def effective_tool_choice(self) -> ToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """``tool_choice: "none"`` hides the tools from the model."""
        if self.effective_tool_choice == "none":
            return None
        return super().tool_dicts()


# --------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


def _is_none(value: object) -> bool:
    return value is None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    # Floats, or (encoding_format base64) the little-endian float32 bytes in base64.
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class CompletionLogProbs(BaseModel):
    """The legacy completions logprobs object: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    # Set by a KV connector (a prefill engine: where its KV waits); left out otherwise.
    kv_transfer_params: dict[str, Any] | None = Field(default=None, exclude_if=_is_none)


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    """The reply; ``tool_calls`` is left out when there are none, as OpenAI does, and
    ``reasoning_content`` (a reasoning model's thinking, vLLM's field) likewise."""

    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = Field(default=None, exclude_if=_is_none)
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_is_none)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    # Set by a KV connector (a prefill engine: where its KV waits); left out otherwise.
    kv_transfer_params: dict[str, Any] | None = Field(default=None, exclude_if=_is_none)


class DeltaMessage(BaseModel):
    """A streamed message fragment; unset fields are left out, as OpenAI does."""

    role: str | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)
    reasoning_content: str | None = Field(default=None, exclude_if=_is_none)
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=_is_none)


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tokenloom"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Every 4xx/5xx answer: ``param`` names the offending request field, if any."""

    error: ErrorInfo


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(BaseModel):
    """Body of ``/v1/load_lora_adapter``: serve the PEFT adapter at ``lora_path`` as
    the model ``lora_name``."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """Body of ``/v1/unload_lora_adapter``."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
