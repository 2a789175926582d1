"""POST /v1/completions: one or more prompts, ``n`` completions each, optionally streamed."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tokenloom.outputs import CompletionOutput, RequestOutput

from .errors import OpenAIError, from_value_error
from .protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from .serving_base import (
    SAMPLING_FIELDS,
    SSE_DONE,
    OpenAIServing,
    aclose_all,
    finite_logprob,
    json_response,
    last_output,
    merge_streams,
    new_request_id,
    prime,
    sse,
    sse_error,
    top_entries,
    trace_headers,
)

logger = logging.getLogger(__name__)


class OpenAIServingCompletion:
    """Turns a CompletionRequest into engine requests (one per prompt) and back."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        serving = self.serving
        lora = serving.check_model(request.model)
        try:
            params = request.to_sampling_params()
        except ValueError as exc:
            raise from_value_error(exc, SAMPLING_FIELDS, None) from exc
        # The engine's checks of the constraint name structured_outputs: blame
        # the request field it came from.
        source = request.output_constraint()[1] or "structured_outputs"
        fields = dict(SAMPLING_FIELDS, structured_outputs=source)
        prompts = request.prompts()
        serving.check_capacity(len(prompts))
        request_id = new_request_id("cmpl")
        streams = [
            serving.generate(
                prompt,
                params,
                f"{request_id}-{i}",
                priority=request.priority,
                delta=request.stream,
                fields=fields,
                prompt_param="prompt",
                lora_request=lora,
                trace_headers=trace_headers(raw_request),
            )
            for i, prompt in enumerate(prompts)
        ]
        if request.stream:
            primed = await serving.until_ready(raw_request, [prime(s) for s in streams], streams)
            return StreamingResponse(
                self._stream(request, request_id, prompts, primed),
                media_type="text/event-stream",
            )
        finals = await serving.until_ready(raw_request, [last_output(s) for s in streams], streams)
        # Echoed prompts are decoded only now, once the engine has accepted (and so
        # bounded) them.
        prefixes = [await serving.prompt_text(p) if request.echo else "" for p in prompts]
        return await json_response(lambda: self._response(request, request_id, prefixes, finals))

    def _response(
        self,
        request: CompletionRequest,
        request_id: str,
        prefixes: Sequence[str],
        finals: Sequence[RequestOutput],
    ) -> CompletionResponse:
        choices: list[CompletionChoice] = []
        prompt_tokens = completion_tokens = 0
        for i, (prefix, final) in enumerate(zip(prefixes, finals, strict=True)):
            prompt_tokens += len(final.prompt_token_ids)
            for out in final.outputs:
                completion_tokens += len(out.token_ids)
                logprobs = None
                if request.logprobs is not None:
                    logprobs, _ = self._logprobs(out, request.logprobs, 0)
                choices.append(
                    CompletionChoice(
                        index=i * request.n + out.index,
                        text=prefix + out.text,
                        logprobs=logprobs,
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                    )
                )
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(
            id=request_id,
            model=self.serving.model_name,
            choices=choices,
            usage=UsageInfo.of(prompt_tokens, completion_tokens),
            # One prompt's (a prefill engine's answer to a disaggregation proxy).
            kv_transfer_params=finals[0].kv_transfer_params if len(finals) == 1 else None,
        )

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: Sequence[str | list[int]],
        streams: Sequence[AsyncIterator[RequestOutput]],
    ) -> AsyncIterator[str]:
        model = self.serving.model_name
        include_usage = request.include_usage_in_stream
        drop = () if include_usage else ("usage",)
        prompt_tokens = [0] * len(prompts)
        completion_tokens = 0
        started: set[int] = set()
        offsets: dict[int, int] = {}
        merged = merge_streams(streams)
        try:
            async for i, output in merged:
                prompt_tokens[i] = len(output.prompt_token_ids)
                for out in output.outputs:
                    index = i * request.n + out.index
                    completion_tokens += len(out.token_ids)
                    text = out.text
                    if index not in started:
                        started.add(index)
                        if request.echo:
                            text = await self.serving.prompt_text(prompts[i]) + text
                    logprobs = None
                    if request.logprobs is not None and out.token_ids:
                        logprobs, offsets[index] = self._logprobs(
                            out, request.logprobs, offsets.get(index, 0)
                        )
                    if not text and logprobs is None and out.finish_reason is None:
                        continue
                    choice = CompletionChoice(
                        index=index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                    )
                    chunk = CompletionChunk(id=request_id, model=model, choices=[choice])
                    yield sse(chunk, drop=drop)
            if include_usage:
                usage = UsageInfo.of(sum(prompt_tokens), completion_tokens)
                yield sse(CompletionChunk(id=request_id, model=model, choices=[], usage=usage))
        except Exception as exc:
            if not isinstance(exc, OpenAIError):
                logger.exception("completion stream %s failed", request_id)
            yield sse_error(exc)
        finally:
            await merged.aclose()  # first: it may still be pumping the streams
            await aclose_all(streams)
        yield SSE_DONE

    def _logprobs(
        self, out: CompletionOutput, num_top: int, offset: int
    ) -> tuple[CompletionLogProbs, int]:
        """The legacy logprobs object for ``out``'s tokens; also returns the next text offset."""
        result = CompletionLogProbs()
        entries = out.logprobs or []
        for position, token_id in enumerate(out.token_ids):
            token = self.serving.token_str(token_id)
            per_token = entries[position] if position < len(entries) else None
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
            if per_token is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(finite_logprob(per_token.get(token_id)))
            top: dict[str, float] = {}
            for top_id, logprob in top_entries(per_token, num_top):
                top.setdefault(self.serving.token_str(top_id), finite_logprob(logprob))
            result.top_logprobs.append(top)
        return result, offset
