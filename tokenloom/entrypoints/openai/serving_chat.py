"""POST /v1/chat/completions: messages through the model's chat template, optionally streamed.

With ``tools``, the reply's tool calls are extracted by a tool-call parser
(``tools.tool_parser_for``) and sent as ``message.tool_calls`` with
``finish_reason: "tool_calls"``; streamed, as OpenAI's tool-call deltas.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tokenloom.engine.exceptions import EngineDeadError
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
    finite_logprob,
    json_response,
    last_output,
    new_request_id,
    prime,
    sse,
    sse_error,
    top_entries,
)
from .tool_parsers import ToolCallDelta, ToolCallStreamer, ToolParser
from .tools import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    new_tool_call_id,
    tool_parser_for,
)

logger = logging.getLogger(__name__)

# What a render_chat ValueError may name (its message starts with the field).
_TEMPLATE_FIELDS = {
    name: name
    for name in (
        "messages",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
    )
}
_UNTRUSTED_TEMPLATE = (
    "a chat template sent with the request runs only on a server started with "
    "--trust-request-chat-template"
)


class OpenAIServingChat:
    """Has the engine render the conversation, runs it, and answers in chat format.

    A chat template sent with the request is Jinja code of the client's choosing,
    which can run for as long as it likes; like vLLM, the server takes one only
    when started with ``--trust-request-chat-template``.
    """

    def __init__(
        self,
        serving: OpenAIServing,
        trust_request_chat_template: bool = False,
        tool_call_parser: str | None = None,
    ) -> None:
        self.serving = serving
        self.trust_request_chat_template = trust_request_chat_template
        self.tool_call_parser = tool_call_parser

    def _tool_parser(self, request: ChatCompletionRequest) -> ToolParser | None:
        return tool_parser_for(request.tools, request.effective_tool_choice, self.tool_call_parser)

    async def render(self, request: ChatCompletionRequest) -> list[int]:
        """The prompt token ids of the conversation (rendered off the event loop by the engine)."""
        if not self.trust_request_chat_template:
            if request.chat_template is not None:
                raise OpenAIError(_UNTRUSTED_TEMPLATE, param="chat_template")
            if "chat_template" in (request.chat_template_kwargs or {}):
                raise OpenAIError(_UNTRUSTED_TEMPLATE, param="chat_template_kwargs")
        conversation = [message.to_template_dict() for message in request.messages]
        try:
            rendered = await self.serving.engine.render_chat(conversation, request.chat_options())
        except ValueError as exc:
            raise from_value_error(exc, _TEMPLATE_FIELDS, "messages") from exc
        except EngineDeadError as exc:
            raise OpenAIError(f"the engine is dead: {exc}", status=500) from exc
        return rendered.token_ids

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        serving = self.serving
        lora = serving.check_model(request.model)
        fields = dict(SAMPLING_FIELDS, max_tokens=request.max_tokens_param, logprobs="top_logprobs")
        try:
            params = request.to_sampling_params()
        except ValueError as exc:
            raise from_value_error(exc, fields, None) from exc
        # The engine's checks of the constraint name structured_outputs: blame
        # the request field it came from.
        fields["structured_outputs"] = request.output_constraint()[1] or "structured_outputs"
        serving.check_capacity(1)
        prompt_ids = await self.render(request)
        request_id = new_request_id("chatcmpl")
        stream = serving.generate(
            prompt_ids,
            params,
            request_id,
            priority=request.priority,
            delta=request.stream,
            fields=fields,
            prompt_param="messages",
            lora_request=lora,
        )
        if request.stream:
            [primed] = await serving.until_ready(raw_request, [prime(stream)], [stream])
            return StreamingResponse(
                self._stream(request, request_id, primed), media_type="text/event-stream"
            )
        [final] = await serving.until_ready(raw_request, [last_output(stream)], [stream])
        return await json_response(lambda: self._response(request, request_id, final))

    def _response(
        self, request: ChatCompletionRequest, request_id: str, final: RequestOutput
    ) -> ChatCompletionResponse:
        choices = []
        for out in sorted(final.outputs, key=lambda o: o.index):
            message = ChatResponseMessage(content=out.text)
            finish_reason = out.finish_reason
            parser = self._tool_parser(request)
            if parser is not None:
                parsed = parser.parse(out.text, final=True)
                calls = [c for c in parsed.calls if c.name is not None]
                if calls:
                    message = ChatResponseMessage(
                        content=parsed.content,
                        tool_calls=[
                            ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments))
                            for c in calls
                            if c.name is not None
                        ],
                    )
                    finish_reason = _tool_finish(finish_reason)
            choices.append(
                ChatCompletionChoice(
                    index=out.index,
                    message=message,
                    logprobs=self._logprobs(out, request.top_logprobs or 0)
                    if request.logprobs
                    else None,
                    finish_reason=finish_reason,
                    stop_reason=out.stop_reason,
                )
            )
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
        # Per choice with tools: the text so far and what of it was already sent.
        tool_streams = {}
        if self._tool_parser(request) is not None:
            tool_streams = {i: _ToolStream(self._tool_parser(request)) for i in range(request.n)}
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
                    finish_reason = out.finish_reason
                    tools = tool_streams.get(out.index)
                    if tools is not None:
                        delta = tools.feed(out.text, finished=finish_reason is not None)
                        if tools.num_calls and finish_reason is not None:
                            finish_reason = _tool_finish(finish_reason)
                    else:
                        delta = DeltaMessage(content=out.text) if out.text else DeltaMessage()
                    if (
                        delta.content is None
                        and delta.tool_calls is None
                        and logprobs is None
                        and finish_reason is None
                    ):
                        continue
                    yield chunk(
                        ChatStreamChoice(
                            index=out.index,
                            delta=delta,
                            logprobs=logprobs,
                            finish_reason=finish_reason,
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
                ChatTopLogprob(
                    token=(t := self.serving.token_str(tid)),
                    logprob=finite_logprob(lp),
                    bytes=_utf8(t),
                )
                for tid, lp in top_entries(per_token, num_top)
            ]
            content.append(
                ChatTokenLogprob(
                    token=token,
                    logprob=finite_logprob(per_token.get(token_id)),
                    bytes=_utf8(token),
                    top_logprobs=top,
                )
            )
        return ChatChoiceLogprobs(content=content)


class _ToolStream:
    """One streamed choice of a request with tools: text in, content and tool-call deltas out."""

    def __init__(self, parser: ToolParser | None) -> None:
        assert parser is not None
        self.streamer = ToolCallStreamer(parser)
        self.text = ""
        self.ids: list[str] = []

    @property
    def num_calls(self) -> int:
        return self.streamer.num_calls

    def feed(self, text_delta: str, *, finished: bool) -> DeltaMessage:
        self.text += text_delta
        content, deltas = self.streamer.update(self.text, final=finished)
        calls = [self._delta(d) for d in deltas]
        return DeltaMessage(content=content or None, tool_calls=calls or None)

    def _delta(self, delta: ToolCallDelta) -> DeltaToolCall:
        if delta.name is not None:
            # The first fragment of a call: its id, type and name (OpenAI's order).
            self.ids.append(new_tool_call_id())
            return DeltaToolCall(
                index=delta.index,
                id=self.ids[delta.index],
                type="function",
                function=DeltaFunctionCall(name=delta.name, arguments=delta.arguments),
            )
        return DeltaToolCall(
            index=delta.index, function=DeltaFunctionCall(arguments=delta.arguments)
        )


def _tool_finish(finish_reason: str | None) -> str | None:
    """A reply that made tool calls and stopped by itself finished with ``tool_calls``."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))
