"""POST /v1/chat/completions: messages through the model's chat template, optionally streamed."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenloom.outputs import CompletionOutput, RequestOutput

from .errors import OpenAIError, from_value_error
from .protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaMessage,
    UsageInfo,
)
from .serving_base import (
    SAMPLING_FIELDS,
    SSE_DONE,
    OpenAIServing,
    aclose_all,
    last_output,
    new_request_id,
    prime,
    sse,
    sse_error,
    top_entries,
)

logger = logging.getLogger(__name__)


class OpenAIServingChat:
    """Renders the conversation to token ids, runs it, and answers in chat format."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def render(self, request: ChatCompletionRequest) -> list[int]:
        conversation = [message.to_template_dict() for message in request.messages]
        return render_chat_prompt(
            self.serving.tokenizer,
            conversation,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
        )

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        serving = self.serving
        serving.check_model(request.model)
        fields = dict(SAMPLING_FIELDS, max_tokens=request.max_tokens_param, logprobs="top_logprobs")
        try:
            params = request.to_sampling_params()
        except ValueError as exc:
            raise from_value_error(exc, fields, None) from exc
        prompt_ids = self.render(request)
        serving.check_capacity(1)
        request_id = new_request_id("chatcmpl")
        stream = serving.generate(
            prompt_ids,
            params,
            request_id,
            priority=request.priority,
            delta=request.stream,
            fields=fields,
            prompt_param="messages",
        )
        if request.stream:
            [primed] = await serving.until_ready(raw_request, [prime(stream)], [stream])
            return StreamingResponse(
                self._stream(request, request_id, primed), media_type="text/event-stream"
            )
        [final] = await serving.until_ready(raw_request, [last_output(stream)], [stream])
        return JSONResponse(self._response(request, request_id, final).model_dump())

    def _response(
        self, request: ChatCompletionRequest, request_id: str, final: RequestOutput
    ) -> ChatCompletionResponse:
        choices = [
            ChatCompletionChoice(
                index=out.index,
                message=ChatResponseMessage(content=out.text),
                logprobs=self._logprobs(out, request.top_logprobs or 0)
                if request.logprobs
                else None,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
            )
            for out in sorted(final.outputs, key=lambda o: o.index)
        ]
        completion_tokens = sum(len(out.token_ids) for out in final.outputs)
        return ChatCompletionResponse(
            id=request_id,
            model=self.serving.model_name,
            choices=choices,
            usage=UsageInfo.of(len(final.prompt_token_ids), completion_tokens),
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        stream: AsyncIterator[RequestOutput],
    ) -> AsyncIterator[str]:
        model = self.serving.model_name
        include_usage = request.include_usage_in_stream
        drop = () if include_usage else ("usage",)

        def chunk(choice: ChatStreamChoice) -> str:
            return sse(ChatCompletionChunk(id=request_id, model=model, choices=[choice]), drop=drop)

        prompt_tokens = completion_tokens = 0
        try:
            for index in range(request.n):
                role = DeltaMessage(role="assistant", content="")
                yield chunk(ChatStreamChoice(index=index, delta=role))
            async for output in stream:
                prompt_tokens = len(output.prompt_token_ids)
                for out in output.outputs:
                    completion_tokens += len(out.token_ids)
                    logprobs = None
                    if request.logprobs and out.token_ids:
                        logprobs = self._logprobs(out, request.top_logprobs or 0)
                    if not out.text and logprobs is None and out.finish_reason is None:
                        continue
                    delta = DeltaMessage(content=out.text) if out.text else DeltaMessage()
                    yield chunk(
                        ChatStreamChoice(
                            index=out.index,
                            delta=delta,
                            logprobs=logprobs,
                            finish_reason=out.finish_reason,
                            stop_reason=out.stop_reason,
                        )
                    )
            if include_usage:
                usage = UsageInfo.of(prompt_tokens, completion_tokens)
                yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[], usage=usage))
        except Exception as exc:
            if not isinstance(exc, OpenAIError):
                logger.exception("chat stream %s failed", request_id)
            yield sse_error(exc)
        finally:
            await aclose_all([stream])
        yield SSE_DONE

    def _logprobs(self, out: CompletionOutput, num_top: int) -> ChatChoiceLogprobs:
        content: list[ChatTokenLogprob] = []
        entries = out.logprobs or []
        for position, token_id in enumerate(out.token_ids):
            per_token = entries[position] if position < len(entries) else {}
            token = self.serving.token_str(token_id)
            top = [
                ChatTopLogprob(token=(t := self.serving.token_str(tid)), logprob=lp, bytes=_utf8(t))
                for tid, lp in top_entries(per_token, num_top)
            ]
            content.append(
                ChatTokenLogprob(
                    token=token,
                    # Only missing if the engine dropped it; -9999 is vLLM's placeholder.
                    logprob=per_token.get(token_id, -9999.0),
                    bytes=_utf8(token),
                    top_logprobs=top,
                )
            )
        return ChatChoiceLogprobs(content=content)


def render_chat_prompt(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    """Prompt token ids for a conversation: the chat template's text, tokenized as is.

    Tokenizing without special tokens keeps a BOS the template already wrote
    from being doubled. Template failures (bad roles, raise_exception) become
    a 400 naming ``messages``.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError("this model has no chat template; use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
    except Exception as exc:  # jinja errors, template raise_exception(), bad roles
        raise OpenAIError(f"cannot apply the chat template: {exc}", "messages") from exc
    return list(tokenizer.encode(text, add_special_tokens=False))


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))
