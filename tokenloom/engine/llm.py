"""``LLM``: offline batch generation (and embedding, with ``runner="pooling"``) with the
engine core in this process."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import msgspec

from tokenloom.engine.args import EngineArgs
from tokenloom.engine.core_client import InprocClient
from tokenloom.engine.messages import EngineCoreRequest
from tokenloom.engine.output_processor import AnyRequestOutput
from tokenloom.engine.protocol import ChatOptions, PromptType
from tokenloom.engine.setup import EngineSetup
from tokenloom.lora_request import LoRARequest
from tokenloom.metrics.stats import IterationStats, StatLogger
from tokenloom.outputs import (
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# Batches at least this large get a progress bar (when use_tqdm is on).
_TQDM_MIN_PROMPTS = 8


class LLM:
    """Generate for a batch of prompts; results come back in input order.

    ``engine_args`` are ``EngineArgs``' arguments (``max_model_len``,
    ``num_blocks``, ``max_num_seqs``, ...). Invalid prompts or parameters raise
    ``ValueError`` before anything is queued, so the engine stays usable.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self._start(EngineArgs(model, **engine_args))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        """An ``LLM`` from arguments already built (say, from CLI flags)."""
        llm = cls.__new__(cls)
        llm._start(engine_args)
        return llm

    def _start(self, engine_args: EngineArgs) -> None:
        from tokenloom.engine.core import EngineCore

        if engine_args.config.parallel_config.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size: LLM runs one engine core in this process; "
                "use AsyncLLM or `tokenloom serve -dp N` for data parallel"
            )
        self.engine_args = engine_args
        setup = EngineSetup.from_engine_args(engine_args)
        tokenizer = setup.load_tokenizer()
        self.client = InprocClient(EngineCore.from_config(*setup.core_configs))
        self.max_model_len = self.client.max_model_len
        front_end = setup.front_end(tokenizer, self.max_model_len)
        self.tokenizer: PreTrainedTokenizerFast = tokenizer
        self.input_processor = front_end.input_processor
        self.output_processor = front_end.output_processor
        self.stat_loggers: list[StatLogger] = front_end.stat_loggers
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> PreTrainedTokenizerFast:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt (a str, token ids, or a list of either).

        A prompt with images is vLLM's dict: ``{"prompt": text, "multi_modal_data":
        {"image": PIL.Image or a list of them}}``, one image placeholder (the
        model's, e.g. ``<image>``) in the text per image.

        ``lora_request``: one adapter for every prompt, or one (or None, the base
        model) per prompt; needs ``enable_lora=True``."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        lora_list = _as_lora_list(lora_request, len(prompt_list))
        batch = []
        for prompt, params, lora in zip(prompt_list, params_list, lora_list, strict=True):
            request_id = self._next_id()
            batch.append(
                (
                    request_id,
                    *self.input_processor.process(request_id, prompt, params, lora_request=lora),
                )
            )
        return cast(list[RequestOutput], self._run(batch, use_tqdm))

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """One ``PoolingRequestOutput`` per prompt (its pooled vector in
        ``outputs.data``); needs ``runner="pooling"``. Each prompt is prefilled,
        possibly in chunks, batched with the others, and never decodes."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_list(pooling_params, PoolingParams, len(prompt_list), "pooling_params")
        batch = []
        for prompt, params in zip(prompt_list, params_list, strict=True):
            request_id = self._next_id()
            batch.append(
                (request_id, *self.input_processor.process_pooling(request_id, prompt, params))
            )
        return cast(list[PoolingRequestOutput[PoolingOutput]], self._run(batch, use_tqdm))

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``), in order; needs
        ``runner="pooling"``. ``truncate_prompt_tokens`` keeps each prompt's last
        tokens (-1: the context length), for every prompt without its own."""
        if truncate_prompt_tokens is not None:
            count = len(_as_prompt_list(prompts))
            pooling_params = [
                p
                if p.truncate_prompt_tokens is not None
                else msgspec.structs.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                for p in _as_list(pooling_params, PoolingParams, count, "pooling_params")
            ]
        outputs = self.encode(prompts, pooling_params, use_tqdm)
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template.

        ``chat_template`` overrides the engine's (``--chat-template``, else the
        model's); ``chat_template_kwargs`` become extra template variables. Errors
        are ``ValueError``s naming the field, raised before anything is queued.
        """
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations")
        conversations = messages if isinstance(messages[0], list) else [messages]
        params_list = _as_params_list(sampling_params, len(conversations))
        options = ChatOptions(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs if chat_template_kwargs is not None else {},
        )
        batch = []
        for conversation, params in zip(conversations, params_list, strict=True):
            rendered = self.input_processor.render_chat(conversation, options)
            request_id = self._next_id()
            text, requests = self.input_processor.process(
                request_id, rendered.prompt, params, prompt_text=rendered.text
            )
            batch.append((request_id, text, requests))
        return cast(list[RequestOutput], self._run(batch, use_tqdm))

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget the prefix cache (for example between benchmark runs); False if it could not."""
        return self.client.reset_prefix_cache(reset_running_requests)

    def _next_id(self) -> str:
        return str(next(self._request_counter))

    def _run(
        self, batch: list[tuple[str, str | None, list[EngineCoreRequest]]], use_tqdm: bool
    ) -> list[AnyRequestOutput]:
        order: list[str] = []
        results: dict[str, AnyRequestOutput] = {}
        for request_id, text, requests in batch:
            self.output_processor.add_request(request_id, text, requests)
            order.append(request_id)
            for request in requests:
                self.client.add_request(request)
        progress = (
            _progress_bar(len(order)) if use_tqdm and len(order) >= _TQDM_MIN_PROMPTS else None
        )
        try:
            while self.output_processor.has_unfinished_requests():
                result = self.client.step()
                if result is None:
                    raise RuntimeError("engine core stopped with requests unfinished")
                stats = IterationStats() if self.stat_loggers else None
                processed = self.output_processor.process_outputs(
                    result.outputs.outputs, time.time(), stats, result.first_scheduled_times
                )
                self.client.abort_requests(processed.reqs_to_abort)
                for output in processed.request_outputs:
                    results[output.request_id] = output
                if progress is not None and processed.request_outputs:
                    progress.update(len(processed.request_outputs))
                for stat_logger in self.stat_loggers:
                    stat_logger.record(result.outputs.scheduler_stats, stats)
        except BaseException:
            # Leave the engine clean for the next call (Ctrl-C, or a failure above).
            self.client.abort_requests(self.output_processor.abort_requests(order))
            raise
        finally:
            if progress is not None:
                progress.close()
        return [results[request_id] for request_id in order]


def _progress_bar(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) for t in value)


def _as_prompt_list(prompts: object) -> list[PromptType]:
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
        return [prompts]  # type: ignore[list-item]
    if isinstance(prompts, (list, tuple)):
        for prompt in prompts:
            if not isinstance(prompt, (str, list, dict)):
                raise ValueError(
                    "prompts must be a str, a list of token ids, a prompt dict (with "
                    "multi_modal_data), or a list of those; "
                    f"got an element of type {type(prompt).__name__}"
                )
        return list(prompts)
    raise ValueError(f"prompts must be a str or a list, got {type(prompts).__name__}")


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    return _as_list(params, SamplingParams, count, "sampling_params")


P = TypeVar("P", SamplingParams, PoolingParams)


def _as_list(params: P | Sequence[P] | None, kind: type[P], count: int, name: str) -> list[P]:
    """One parameters object per prompt: the default, one for all, or one each."""
    if params is None:
        return [kind()] * count
    if isinstance(params, kind):
        return [params] * count
    params_list = list(params)  # type: ignore[arg-type]
    if len(params_list) != count:
        raise ValueError(
            f"{name} has {len(params_list)} entries for {count} prompts; "
            f"pass one {kind.__name__} or one per prompt"
        )
    return params_list


def _as_lora_list(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if not isinstance(lora_request, (list, tuple)):
        raise ValueError(
            f"lora_request must be a LoRARequest or a list of them, got {type(lora_request).__name__}"
        )
    if len(lora_request) != count:
        raise ValueError(
            f"lora_request has {len(lora_request)} entries for {count} prompts; "
            "pass one LoRARequest or one per prompt"
        )
    return list(lora_request)
