"""Prompts in, validated ``EngineCoreRequest``s out; conversations through the chat template.

Runs in the front end, before anything reaches the engine core, so a bad
request is refused with a ``ValueError`` whose message starts with the field
to blame (``prompt``, ``logprobs``, ``messages``, ...) and never disturbs the
requests already running. Imports no torch.

Prompts with images (a vision-language model): chat messages' image parts
are loaded in ``render_chat`` and left as placeholders for the template; a
prompt dict's ``multi_modal_data`` goes through the model's image processor
(``multimodal.processing``), which expands the placeholders and gives the
core request its ``mm_features``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tokenloom.config import FrontendConfig, LoRAConfig
from tokenloom.engine.chat_template import is_utf8, render_chat
from tokenloom.engine.messages import EngineCoreRequest
from tokenloom.engine.protocol import ChatOptions, PromptType, RenderedChat
from tokenloom.lora_request import LoRARequest
from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.model.peft_config import validate_adapter
from tokenloom.multimodal.chat import extract_images, inline_placeholders
from tokenloom.multimodal.inputs import MultiModalFeatureSpec
from tokenloom.multimodal.media import MediaLimits
from tokenloom.multimodal.processing import MultiModalProcessor
from tokenloom.pooling.config import PoolerConfig
from tokenloom.pooling_params import PoolingParams
from tokenloom.reasoning import get_reasoning_parser
from tokenloom.sampling_params import SamplingParams
from tokenloom.structured_output.reasoning_gate import ReasoningTokens
from tokenloom.structured_output.validator import ConstraintValidator

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


class InputProcessor:
    """Tokenizes and validates prompts against the model's context and vocabulary.

    ``eos_token_ids[0]`` becomes the request's EOS token; the others are added
    to its stop token ids unless it ignores EOS. ``chat_template`` is the
    engine's default template (``--chat-template``), used before the model's.
    With ``reasoning_parser``, a structured request's grammar applies after
    the thinking its prompt leaves to the model (``ValueError`` at once when
    the model's vocabulary lacks the parser's tags).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: list[int],
        *,
        max_logprobs: int = FrontendConfig.max_logprobs,
        chat_template: str | None = None,
        lora_config: LoRAConfig | None = None,
        arch: ModelArchConfig | None = None,
        validate_constraints_in_subprocess: bool = False,
        reasoning_parser: str | None = None,
        multimodal: MultiModalProcessor | None = None,
        media_limits: MediaLimits | None = None,
        pooler_config: PoolerConfig | None = None,
        served_model_name: str = "",
    ) -> None:
        """``multimodal``: the model's image processing (None: a text-only model);
        ``media_limits``: what image URLs may name and how large images may be."""
        self.tokenizer = tokenizer
        self.reasoning = (
            None
            if reasoning_parser is None
            else ReasoningTokens.resolve(
                get_reasoning_parser(reasoning_parser), tokenizer, vocab_size
            )
        )
        self.multimodal = multimodal
        self.media_limits = media_limits or MediaLimits()
        # A pooling engine's (None: it generates); completes embedding requests.
        self.pooler_config = pooler_config
        self.served_model_name = served_model_name
        # The serving front end checks grammars in a helper process (the backend
        # imports torch); the offline LLM checks them in place.
        self.validate_constraints = ConstraintValidator(validate_constraints_in_subprocess)
        # LoRA: adapters are checked against the base model (``arch``) once per id.
        self.lora_config = lora_config
        self.arch = arch
        self._adapter_paths: dict[int, str] = {}
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_logprobs = max_logprobs
        self.chat_template = chat_template

    def tokenize(
        self, prompt: PromptType, *, max_len: int | None = None
    ) -> tuple[str | None, list[int]]:
        """Return ``(prompt text or None, prompt token ids)``; a text prompt over ``max_len``
        tokens is refused (default: ``max_model_len - 1``, leaving room to generate)."""
        if isinstance(prompt, Mapping):
            fields: Mapping[str, Any] = prompt
            if "prompt" in fields:
                return self.tokenize(fields["prompt"], max_len=max_len)
            if "prompt_token_ids" in fields:
                return self.tokenize(fields["prompt_token_ids"], max_len=max_len)
            raise ValueError("prompt must have a 'prompt' (text) or a 'prompt_token_ids' key")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if not is_utf8(prompt):
                raise ValueError(
                    "prompt contains a lone surrogate (U+D800-U+DFFF), "
                    "which cannot be encoded as UTF-8"
                )
            # The Rust tokenizer's batch call works without the GIL (its single-text
            # encode holds it throughout), and only a prompt that can fit becomes a
            # Python list: a huge prompt's millions of ids would hold the GIL, and
            # so the event loop, for long.
            (encoding,) = self.tokenizer.backend_tokenizer.encode_batch_fast([prompt])
            if max_len is None and len(encoding) >= self.max_model_len:
                raise ValueError(self._no_room(len(encoding)))
            if max_len is not None and len(encoding) > max_len:
                raise ValueError(self._too_long(len(encoding)))
            return prompt, encoding.ids
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
        lora_request: LoRARequest | None = None,
        tenant: str = "",
        tenant_weight: float = 1.0,
    ) -> tuple[str | None, list[EngineCoreRequest]]:
        """Validate one prompt; return its text and one core request per completion (``n``).

        ``prompt_text`` names the text of a prompt given as token ids (a rendered chat).
        ``tenant`` and ``tenant_weight`` name who sent it (for the fair policy).
        """
        if self.pooler_config is not None:
            raise ValueError(
                "model: this engine runs the pooling runner: it embeds (LLM.embed, "
                "/v1/embeddings) and does not generate"
            )
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        _check_priority_and_tenant(priority, tenant, tenant_weight)
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(
                f"logprobs ({params.logprobs}) exceeds the engine's limit of {self.max_logprobs} "
                "(max_logprobs)"
            )
        if lora_request is not None:
            self.check_adapter(lora_request)
        text, token_ids = self.tokenize(prompt)
        text = text if prompt_text is None else prompt_text
        mm_features = None
        images = _images_of(prompt)
        if images:
            token_ids, mm_features = self._process_images(token_ids, images)
        elif self.multimodal is not None and self.multimodal.image_token_id in token_ids:
            # Its embeddings would be a token's, not an image's: refused, as transformers does.
            raise ValueError(
                f"prompt holds the image placeholder {self.multimodal.image_token} but no image "
                "comes with it (multi_modal_data, or an image part in a chat message)"
            )
        self._validate(token_ids, params)
        core_params = self._with_eos_stops(params)
        if self.reasoning is not None and params.structured_outputs is not None:
            gate = self.reasoning.gate(self.tokenizer, token_ids)
            structured = dataclasses.replace(params.structured_outputs, reasoning_gate=gate)
            core_params = dataclasses.replace(core_params, structured_outputs=structured)
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
                lora_request=lora_request,
                mm_features=mm_features,
                tenant=tenant,
                tenant_weight=float(tenant_weight),
            )
            for child_id, child_params in children
        ]

    def process_pooling(
        self,
        request_id: str,
        prompt: PromptType,
        params: PoolingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        tenant: str = "",
        tenant_weight: float = 1.0,
    ) -> tuple[str | None, list[EngineCoreRequest]]:
        """Validate one prompt of a pooling (embedding) request; return its text and its
        core request, its parameters completed from the pooler config. A prompt over
        the context is refused unless ``truncate_prompt_tokens`` keeps its last tokens.
        ``tenant`` and ``tenant_weight`` name who sent it (for the fair policy)."""
        pooler = self.pooler_config
        if pooler is None:
            raise ValueError(
                "model: this engine generates text; embeddings need an engine started "
                "with runner='pooling' (--runner pooling)"
            )
        if params is not None and not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        _check_priority_and_tenant(priority, tenant, tenant_weight)
        params = pooler.request_params(params, self.served_model_name)
        limit = self.max_model_len
        truncate = params.truncate_prompt_tokens
        keep = limit if truncate == -1 else truncate
        if keep is not None and keep > limit:
            raise ValueError(
                f"truncate_prompt_tokens ({truncate}) exceeds the maximum context length of "
                f"{limit} tokens"
            )
        text, token_ids = self.tokenize(prompt, max_len=limit if keep is None else sys.maxsize)
        if keep is not None:
            token_ids = token_ids[-keep:]
        self._check_token_ids(token_ids)
        if len(token_ids) > limit:
            raise ValueError(self._too_long(len(token_ids)))
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=_POOLING_SAMPLING,
            eos_token_id=None,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            pooling_params=params,
            tenant=tenant,
            tenant_weight=float(tenant_weight),
        )
        return text, [request]

    def check_adapter(self, lora_request: LoRARequest) -> None:
        """Refuse an adapter the engine could not load (LoRA off, bad path, rank
        above max_lora_rank, shapes of another model) or an id reused for another path."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"lora_request must be a LoRARequest, got {type(lora_request).__name__}"
            )
        if self.lora_config is None or self.arch is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True")
        known = self._adapter_paths.get(lora_request.lora_int_id)
        if known is not None:
            if known != lora_request.lora_path:
                raise ValueError(
                    f"lora_int_id {lora_request.lora_int_id} already names the adapter at "
                    f"{known}, not {lora_request.lora_path}"
                )
            return
        validate_adapter(lora_request.lora_path, self.lora_config.max_lora_rank, self.arch)
        self._adapter_paths[lora_request.lora_int_id] = lora_request.lora_path

    def render_chat(
        self,
        messages: object,
        options: ChatOptions | None = None,
        fetched: Mapping[str, bytes] | None = None,
    ) -> RenderedChat:
        """One conversation through the chat template (see ``chat_template.render_chat``).

        Image parts are loaded (``fetched``: bytes of http(s) image URLs fetched
        already) and become the model's placeholders: the template places them
        when it knows images, else they are written into the message text."""
        options = options or ChatOptions()
        images: list[Any] = []
        if isinstance(messages, list):
            messages, images = extract_images(messages, self.media_limits, fetched)
        if images:
            assert isinstance(messages, list)
            if self.multimodal is None:
                raise ValueError("messages: this model takes no images")
            self.multimodal.check_count(len(images), "messages")
            template = options.chat_template or self.chat_template or self.tokenizer.chat_template
            if "image" not in str(template or ""):  # the template only writes text
                messages = inline_placeholders(messages, self.multimodal.placeholder_text)
        rendered = render_chat(self.tokenizer, messages, options, self.chat_template)
        rendered.images = images
        return rendered

    def _process_images(
        self, token_ids: list[int], images: list[Any]
    ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        if self.multimodal is None:
            raise ValueError("multi_modal_data: this model takes no images")
        return self.multimodal.process(token_ids, images)

    def shutdown(self) -> None:
        """Stop the helper processes (grammar checks, image processing), if any started."""
        self.validate_constraints.shutdown()
        if self.multimodal is not None:
            self.multimodal.shutdown()

    def _check_token_ids(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        self._check_token_ids(token_ids)
        num = len(token_ids)
        if num >= self.max_model_len:
            raise ValueError(self._no_room(num))
        if params.max_tokens is not None and num + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({num} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"maximum context length of {self.max_model_len} tokens"
            )
        if params.stop_token_ids and any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {self.vocab_size}")
        if params.structured_outputs is not None:
            # Here, not in the engine: a constraint the backend cannot compile
            # is refused before it could disturb anything (ValueError naming
            # structured_outputs.<field>).
            self.validate_constraints(params.structured_outputs)

    def _no_room(self, num_tokens: int) -> str:
        return (
            f"prompt is {num_tokens} tokens, which leaves no room to generate within the "
            f"maximum context length of {self.max_model_len} tokens"
        )

    def _too_long(self, num_tokens: int) -> str:
        return (
            f"prompt is {num_tokens} tokens, more than the maximum context length of "
            f"{self.max_model_len} tokens (truncate_prompt_tokens keeps its last tokens)"
        )

    def _with_eos_stops(self, params: SamplingParams) -> SamplingParams:
        extra = self.eos_token_ids[1:]
        if params.ignore_eos or not extra:
            return params
        stops = list(params.stop_token_ids or [])
        stops += [t for t in extra if t not in stops]
        return dataclasses.replace(params, stop_token_ids=stops)


# What a pooling request carries as sampling parameters: it never samples.
_POOLING_SAMPLING = SamplingParams(max_tokens=1)


def eos_token_ids(arch_eos_ids: list[int], tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """The model's EOS ids (the checkpoint's first), then the tokenizer's if it differs."""
    ids = list(arch_eos_ids)
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tokenizer_eos, int) and tokenizer_eos not in ids:
        ids.append(tokenizer_eos)
    return ids


def _images_of(prompt: PromptType) -> list[Any]:
    """The images of a prompt dict's ``multi_modal_data`` (``ValueError`` naming it)."""
    if not isinstance(prompt, Mapping):
        return []
    data = prompt.get("multi_modal_data")
    if data is None:
        return []
    if not isinstance(data, Mapping):
        raise ValueError(f"multi_modal_data must be a dict, got {type(data).__name__}")
    unknown = sorted(str(k) for k in data if k != "image")
    if unknown:
        raise ValueError(f"multi_modal_data.{unknown[0]}: only images are supported")
    images = data.get("image")
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion ``index`` of ``n``: n=1, and a distinct seed so seeded children differ."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)


def _check_priority_and_tenant(priority: int, tenant: str, tenant_weight: float) -> None:
    """Refuse a priority, tenant or tenant weight of the wrong type or range."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if not isinstance(tenant, str):
        raise ValueError(f"tenant must be a string, got {tenant!r}")
    if (
        isinstance(tenant_weight, bool)
        or not isinstance(tenant_weight, (int, float))
        or not 0 < tenant_weight < float("inf")
    ):
        raise ValueError(f"tenant_weight must be a finite number > 0, got {tenant_weight!r}")
