"""POST /v1/chat/completions: messages through the model's chat template, optionally streamed.

The generated text becomes the message through ``chat_reply.ReplyParser``:
with ``--reasoning-parser`` the thinking goes to ``reasoning_content``; with
``tools``, the calls that hold up (``tool_parsers/checked.py``) are sent as
``message.tool_calls`` with ``finish_reason: "tool_calls"`` (``"length"``
when ``max_tokens`` cut the output); streamed, as OpenAI's deltas, each
call whole.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tokenloom.engine.exceptions import EngineDeadError
from tokenloom.engine.protocol import RenderedChat
from tokenloom.multimodal.media import MediaError
from tokenloom.outputs import CompletionOutput, RequestOutput
from tokenloom.reasoning import StartPhase, get_reasoning_parser

from .chat_reply import ReplyDelta, ReplyParser, ReplyStream
from .errors import OpenAIError, from_value_error
from .protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatRenderFields,
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
    trace_headers,
)
from .tool_parsers import CheckedCall, ToolCallChecker, ToolParser
from .tools import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    new_tool_call_id,
    tool_checker,
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
        enable_auto_tool_choice: bool = False,
        reasoning_parser: str | None = None,
    ) -> None:
        self.serving = serving
        self.trust_request_chat_template = trust_request_chat_template
        # tool_choice "auto" parses the output with this; None: "auto" is refused.
        self.auto_tool_parser = tool_call_parser if enable_auto_tool_choice else None
        self.reasoning = (
            None if reasoning_parser is None else get_reasoning_parser(reasoning_parser)
        )

    def _tool_parsing(
        self, request: ChatCompletionRequest
    ) -> tuple[ToolParser | None, ToolCallChecker | None]:
        """The request's tool parser and checker (None, None: its output holds no calls)."""
        try:
            parser = tool_parser_for(
                request.tools, request.effective_tool_choice, self.auto_tool_parser
            )
            if parser is None:
                return None, None
            return parser, tool_checker(request.tools or [], request.parallel_tool_calls)
        except ValueError as exc:
            raise from_value_error(exc, {"tools": "tools"}, "tool_choice") from exc

    def _reply_parser(
        self,
        tool_parsing: tuple[ToolParser | None, ToolCallChecker | None],
        prompt_ids: list[int],
    ) -> ReplyParser | None:
        """How the output becomes the message; None: its text is the content as is."""
        tools, checker = tool_parsing
        if self.reasoning is None and tools is None:
            return None
        phase = StartPhase.ANSWER
        if self.reasoning is not None:
            phase = self.reasoning.prompt_phase(self.serving.tokenizer, prompt_ids)
        return ReplyParser(self.reasoning, phase, tools, checker)

    async def render(self, request: ChatRenderFields) -> RenderedChat:
        """The conversation through the chat template, with the images it shows (rendered
        off the event loop by the engine; a bad image is a 400 naming its content part,
        413 when it is over the size limit)."""
        if not self.trust_request_chat_template:
            if request.chat_template is not None:
                raise OpenAIError(_UNTRUSTED_TEMPLATE, param="chat_template")
            if "chat_template" in (request.chat_template_kwargs or {}):
                raise OpenAIError(_UNTRUSTED_TEMPLATE, param="chat_template_kwargs")
        conversation = [message.to_template_dict() for message in request.messages]
        try:
            rendered = await self.serving.engine.render_chat(conversation, request.chat_options())
        except MediaError as exc:
            raise OpenAIError(str(exc), exc.param, status=exc.status) from exc
        except ValueError as exc:
            raise from_value_error(exc, _TEMPLATE_FIELDS, "messages") from exc
        except EngineDeadError as exc:
            raise OpenAIError(f"the engine is dead: {exc}", status=500) from exc
        return rendered

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
        tool_parsing = self._tool_parsing(request)  # refused before anything runs
        serving.check_capacity(1)
        rendered = await self.render(request)
        reply = self._reply_parser(tool_parsing, rendered.token_ids)
        request_id = new_request_id("chatcmpl")
        stream = serving.generate(
            rendered.prompt,
            params,
            request_id,
            priority=request.priority,
            delta=request.stream,
            fields=fields,
            prompt_param="messages",
            lora_request=lora,
            trace_headers=trace_headers(raw_request),
        )
        if request.stream:
            [primed] = await serving.until_ready(raw_request, [prime(stream)], [stream])
            return StreamingResponse(
                self._stream(request, request_id, primed, reply), media_type="text/event-stream"
            )
        [final] = await serving.until_ready(raw_request, [last_output(stream)], [stream])
        return await json_response(lambda: self._response(request, request_id, final, reply))

    def _response(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        final: RequestOutput,
        reply: ReplyParser | None,
    ) -> ChatCompletionResponse:
        choices = []
        for out in sorted(final.outputs, key=lambda o: o.index):
            message = ChatResponseMessage(content=out.text)
            finish_reason = out.finish_reason
            if reply is not None:
                view = reply.view(out.text, final=True)
                message = ChatResponseMessage(
                    content=view.content or None,
                    reasoning_content=view.reasoning or None,
                    tool_calls=[_tool_call(call) for call in view.calls] or None,
                )
                finish_reason = _finish_reason(finish_reason, len(view.calls))
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
            kv_transfer_params=final.kv_transfer_params,
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        stream: AsyncIterator[RequestOutput],
        reply: ReplyParser | None,
    ) -> AsyncIterator[str]:
        model = self.serving.model_name
        include_usage = request.include_usage_in_stream
        drop = () if include_usage else ("usage",)

        def chunk(choice: ChatStreamChoice) -> str:
            return sse(ChatCompletionChunk(id=request_id, model=model, choices=[choice]), drop=drop)

        prompt_tokens = completion_tokens = 0
        # Per choice, with a reply parser: the text so far and what of it was sent.
        replies = {} if reply is None else {i: _ChoiceStream(reply) for i in range(request.n)}
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
                    choice_stream = replies.get(out.index)
                    if choice_stream is not None:
                        delta = choice_stream.feed(out.text, finished=finish_reason is not None)
                        if finish_reason is not None:
                            finish_reason = _finish_reason(finish_reason, choice_stream.num_calls)
                    else:
                        delta = DeltaMessage(content=out.text) if out.text else DeltaMessage()
                    if (
                        delta.content is None
                        and delta.reasoning_content is None
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


class _ChoiceStream:
    """One streamed choice: text deltas in, OpenAI message deltas out."""

    def __init__(self, parser: ReplyParser) -> None:
        self.reply = ReplyStream(parser)

    @property
    def num_calls(self) -> int:
        return self.reply.num_calls

    def feed(self, text_delta: str, *, finished: bool) -> DeltaMessage:
        delta: ReplyDelta = self.reply.feed(text_delta, finished=finished)
        calls = [
            # Each call goes out whole: id, type, name and all its arguments.
            DeltaToolCall(
                index=index,
                id=new_tool_call_id(),
                type="function",
                function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
            )
            for index, call in delta.calls
        ]
        return DeltaMessage(
            content=delta.content or None,
            reasoning_content=delta.reasoning or None,
            tool_calls=calls or None,
        )


def _tool_call(call: CheckedCall) -> ToolCall:
    return ToolCall(function=FunctionCall(name=call.name, arguments=call.arguments))


def _finish_reason(finish_reason: str | None, num_calls: int) -> str | None:
    """A reply that made tool calls and stopped by itself finished with ``tool_calls``;
    one cut by ``max_tokens`` says ``length``, whatever calls it holds."""
    return "tool_calls" if finish_reason == "stop" and num_calls else finish_reason


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))
