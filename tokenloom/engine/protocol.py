"""What the HTTP server needs from an engine: the ``EngineClient`` protocol.

``AsyncLLM`` implements it; tests implement it with a fake engine. The server
depends on this protocol only, so nothing in the front end duck-types around
a particular implementation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from tokenloom.engine.exceptions import EngineDeadError
from tokenloom.lora_request import LoRARequest
from tokenloom.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from tokenloom.pooling.config import PoolerConfig
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from tokenloom.metrics.stats import StatLogger


class TextPrompt(TypedDict, total=False):
    """vLLM's prompt dict: text, with images for its placeholders
    (``{"image": PIL.Image or a list of them}``; URLs and encoded bytes are taken too)."""

    prompt: str
    multi_modal_data: dict[str, Any]


class TokensPrompt(TypedDict, total=False):
    """vLLM's prompt dict of token ids, with images for their placeholders."""

    prompt_token_ids: list[int]
    multi_modal_data: dict[str, Any]


# A prompt: text, or token ids (for example a chat already rendered by ``render_chat``),
# or either as a dict with images.
PromptType = str | list[int] | TextPrompt | TokensPrompt


@dataclass
class ChatOptions:
    """How to render a conversation with the chat template (OpenAI/vLLM request fields).

    ``chat_template`` overrides the engine's default template (the server's
    ``--chat-template``, else the model's own); ``chat_template_kwargs`` become
    extra template variables. ``tools`` (OpenAI tool definitions) are shown to
    the model; when no template was chosen and the model's own ignores tools,
    the bundled Hermes-style template renders them.
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None


@dataclass
class RenderedChat:
    """A conversation rendered by the chat template: its text and prompt token ids, and
    the images its messages showed (loaded, in order; one placeholder each)."""

    text: str
    token_ids: list[int]
    images: list[Any] = field(default_factory=list)

    @property
    def prompt(self) -> list[int] | TokensPrompt:
        """What ``generate`` takes for it."""
        if not self.images:
            return self.token_ids
        return TokensPrompt(
            prompt_token_ids=self.token_ids, multi_modal_data={"image": self.images}
        )


class EngineClient(Protocol):
    """An asyncio engine serving many concurrent ``generate`` streams."""

    model_name: str
    max_model_len: int
    # Engine cores behind this front end (data parallel); metrics get an ``engine`` label.
    data_parallel_size: int
    tokenizer: PreTrainedTokenizerFast
    stat_loggers: list[StatLogger]
    # The pooling runner's config; None when the engine generates (and cannot embed).
    pooler_config: PoolerConfig | None

    @property
    def errored(self) -> bool:
        """True once the engine core is gone; nothing more will run."""
        ...

    @property
    def dead_error(self) -> EngineDeadError: ...

    @property
    def restarting(self) -> bool:
        """True while a crashed engine core restarts: degraded, not dead."""
        ...

    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` when the engine cannot serve."""
        ...

    async def render_chat(
        self, messages: list[dict[str, Any]], options: ChatOptions
    ) -> RenderedChat:
        """Apply the chat template off the event loop.

        Raises ``ValueError`` whose message starts with the offending field
        (``messages``, ``chat_template`` or ``chat_template_kwargs``).
        """
        ...

    def generate(
        self,
        prompt: PromptType,
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
        """Stream one request's outputs; the last has ``finished=True``.

        ``trace_headers``: the HTTP request's W3C trace context (``traceparent``,
        ``tracestate``), continued by the request's span when tracing is on.
        ``tenant`` (the sender, "" for the default tenant) and ``tenant_weight``
        (its share under the fair policy) travel with the request to the scheduler.

        Tokenization and validation run off the event loop. Raises ``ValueError``
        (naming the field) for an invalid request, ``EngineDeadError`` when the
        engine dies. Closing the iterator early aborts the request.
        """
        ...

    def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None,
        request_id: str,
        *,
        priority: int = 0,
        tenant: str = "",
        tenant_weight: float = 1.0,
    ) -> AsyncIterator[PoolingRequestOutput[PoolingOutput]]:
        """The pooled output of one prompt on a pooling engine, as one final item.

        ``tenant`` and ``tenant_weight`` travel with the request to the scheduler,
        as for ``generate``.

        Raises ``ValueError`` (naming the field: ``prompt``, ``dimensions``,
        ``truncate_prompt_tokens``, ...) for an invalid request and
        ``EngineDeadError`` when the engine dies.
        """
        ...

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Accept a LoRA adapter for later requests, or raise ``ValueError`` saying why not
        (LoRA disabled, bad path, rank above the limit, another model's shapes)."""
        ...

    async def remove_lora(self, lora_int_id: int) -> None:
        """Drop an adapter's weights; the caller ensures no request still uses it."""
        ...

    async def abort(self, request_id: str | Iterable[str]) -> None: ...

    def shutdown(self) -> None: ...
