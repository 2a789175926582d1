"""POST /tokenize and /detokenize (vLLM's routes and shapes).

``/tokenize`` takes a ``prompt`` (text, special tokens added by default) or
chat ``messages`` (rendered by the chat template exactly as a chat completion
would be, tools included; no special tokens added by default, since the
template writes its own) and answers the token ids, their ``count`` and the
server's ``max_model_len``, so a client can check a prompt fits before
sending it; ``return_token_strs`` adds each token's string. ``/detokenize``
turns ``tokens`` back into text. Tokenizing runs off the event loop.
"""

from __future__ import annotations

from fastapi import Request
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

from .body import decode_body
from .errors import OpenAIError, from_validation_error
from .protocol import ChatRenderFields
from .serving_base import OpenAIServing, off_loop, read_body
from .serving_chat import OpenAIServingChat


class TokenizeCompletionRequest(BaseModel):
    """Tokenize ``prompt`` as a completion request would."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(ChatRenderFields):
    """Tokenize a conversation as a chat completion request would render it."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


class _AnyObject(BaseModel):
    """A JSON object, parsed and checked (size, depth, encoding) before its kind is known."""

    model_config = ConfigDict(extra="allow")


async def parse_tokenize_body(raw_request: Request, max_bytes: int) -> TokenizeRequest:
    """A chat request when the body has ``messages``, else a prompt; 400s name the field."""
    body = decode_body(await read_body(raw_request, max_bytes), _AnyObject)
    data = body.model_extra or {}
    kind: type[TokenizeRequest] = (
        TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
    )
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


class OpenAIServingTokenization:
    """The two routes' handlers, over the engine's tokenizer and the chat renderer."""

    def __init__(self, serving: OpenAIServing, chat: OpenAIServingChat) -> None:
        self.serving = serving
        self.chat = chat

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        serving = self.serving
        serving.check_model(request.model)
        tokenizer = serving.tokenizer
        add_special = request.add_special_tokens
        if isinstance(request, TokenizeChatRequest):
            if request.add_generation_prompt and request.continue_final_message:
                raise OpenAIError(
                    "add_generation_prompt and continue_final_message cannot both be true",
                    param="continue_final_message",
                )
            rendered = await self.chat.render(request)
            if add_special:
                text = rendered.text
                tokens = await off_loop(lambda: list(tokenizer.encode(text)))
            else:
                tokens = rendered.token_ids
        else:
            prompt = request.prompt
            tokens = await off_loop(
                lambda: list(tokenizer.encode(prompt, add_special_tokens=add_special))
            )
        token_strs = None
        if request.return_token_strs:
            token_strs = await off_loop(lambda: list(tokenizer.convert_ids_to_tokens(tokens)))
        return TokenizeResponse(
            count=len(tokens),
            max_model_len=serving.engine.max_model_len,
            tokens=tokens,
            token_strs=token_strs,
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        serving = self.serving
        serving.check_model(request.model)
        tokenizer = serving.tokenizer
        vocab = len(tokenizer)
        for index, token in enumerate(request.tokens):
            if not 0 <= token < vocab:
                raise OpenAIError(
                    f"tokens[{index}] is {token}, outside the vocabulary [0, {vocab})",
                    param="tokens",
                )
        tokens = request.tokens
        return DetokenizeResponse(prompt=await off_loop(lambda: str(tokenizer.decode(tokens))))
