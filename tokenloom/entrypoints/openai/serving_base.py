"""What the completions, chat and embeddings handlers share: admission, engine calls, disconnects.

The engine's ``generate`` is an async generator that aborts its request
when it is closed or cancelled; everything here is arranged so that a
client going away, a bad prompt, or a dead engine closes those generators
promptly and turns into an OpenAI error rather than a hang.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import uuid
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from contextlib import AbstractContextManager, aclosing, nullcontext
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from tokenloom.engine.exceptions import EngineDeadError
from tokenloom.engine.protocol import EngineClient, PromptType
from tokenloom.lora_request import LoRARequest
from tokenloom.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams

from .body import decode_body
from .errors import OpenAIError, from_value_error
from .serving_lora import LoRAAdapters
from .tenants import TenantLease, current_lease

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

# SamplingParams field -> request field, for the params both endpoints share.
SAMPLING_FIELDS = {name: name for name in SamplingParams.__dataclass_fields__}

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
# Bodies above this are parsed on a worker thread rather than on the event loop.
_INLINE_PARSE_BYTES = 256 * 2**10


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# The W3C trace context headers a request's span continues (vLLM's TRACE_HEADERS).
TRACE_HEADERS = ("traceparent", "tracestate")


def trace_headers(raw_request: Request) -> dict[str, str] | None:
    """The request's W3C trace context headers, None when it has none."""
    headers = raw_request.headers
    found = {name: headers[name] for name in TRACE_HEADERS if name in headers}
    return found or None


async def read_body(raw_request: Request, max_bytes: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``max_bytes``:
    from Content-Length up front, or while a chunked upload streams in."""
    too_large = OpenAIError(
        f"request body exceeds {max_bytes} bytes (--max-request-bytes)", status=413
    )
    declared = raw_request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in raw_request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientDisconnected from None
    return b"".join(chunks)


async def parse_body(raw_request: Request, model: type[M], max_bytes: int) -> M:
    """Read, parse and validate a JSON body; every failure is a 4xx naming the field."""
    body = await read_body(raw_request, max_bytes)
    if len(body) > _INLINE_PARSE_BYTES:
        return await asyncio.to_thread(decode_body, body, model)
    return decode_body(body, model)


async def off_loop(fn: Callable[[], T]) -> T:
    """Run CPU work (detokenizing, building large responses) on a worker thread."""
    return await asyncio.to_thread(fn)


async def json_response(build: Callable[[], BaseModel]) -> JSONResponse:
    """A JSON response built and encoded off the event loop: with n and logprobs a
    response can hold hundreds of thousands of entries."""
    return await off_loop(lambda: JSONResponse(build().model_dump()))


async def wait_for_disconnect(raw_request: Request) -> None:
    """Return once the client has closed the connection (the body must be read already)."""
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(raw_request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``, cancelling it (and raising ClientDisconnected) if the client leaves."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)
    if work.cancelled():
        raise ClientDisconnected
    return work.result()


async def last_output(stream: AsyncIterator[T]) -> T:
    last: T | None = None
    async for item in stream:
        last = item
    if last is None:
        raise OpenAIError("the engine produced no output", status=500)
    return last


async def gather_or_cancel(awaitables: Sequence[Awaitable[T]]) -> list[T]:
    """Like gather, but the first failure cancels the rest (no orphaned requests)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def prime(stream: AsyncIterator[T]) -> AsyncIterator[T]:
    """Wait for the first item (so errors surface before any byte is sent); replay it."""
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        raise OpenAIError("the engine produced no output", status=500) from None
    except BaseException:
        await _aclose(stream)
        raise
    return _prepend(first, stream)


async def _prepend(first: T, stream: AsyncIterator[T]) -> AsyncIterator[T]:
    try:
        yield first
        async for item in stream:
            yield item
    finally:
        await _aclose(stream)


async def _aclose(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


async def aclose_all(streams: Sequence[AsyncIterator[Any]]) -> None:
    """Close async generators now rather than whenever they are garbage collected."""
    for stream in streams:
        await _aclose(stream)


class _Failure:
    """A stream's exception, passed through the merge queue to the consumer."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T]]:
    """Interleave several streams as items arrive, tagging each with its stream's index."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T] | _Failure | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except Exception as exc:
            await queue.put(_Failure(exc))
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            entry = await queue.get()
            if entry is None:
                remaining -= 1
            elif isinstance(entry, _Failure):
                raise entry.exc
            else:
                yield entry
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class OpenAIServing:
    """Engine access shared by the endpoint handlers.

    ``max_waiting_requests`` bounds the requests that have not produced
    output yet (queued in the engine or on their way to it); past it new
    requests get 503 so that a flood cannot grow the queue without bound.
    """

    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        max_waiting_requests: int | None = None,
        adapters: LoRAAdapters | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        # LoRA adapters requests may name as their model (None: LoRA is off).
        self.adapters = adapters
        self.max_waiting_requests = max_waiting_requests
        self.tokenizer = engine.tokenizer
        self._num_not_started = 0
        # Logprobs name the same few thousand tokens over and over.
        self._token_str = functools.lru_cache(maxsize=1 << 17)(self._decode_token)

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The served name is accepted, and so is the engine's own name (the model path);
        a loaded LoRA adapter's name selects that adapter (returned)."""
        aliases = (self.model_name, self.engine.model_name)
        if model is None or model in aliases:
            return None
        lora = self.adapters.resolve(model) if self.adapters is not None else None
        if lora is not None:
            return lora
        raise OpenAIError(
            f"the model {model[:100]!r} does not exist; this server serves '{self.model_name}'",
            param="model",
        )

    def check_capacity(self, num_new: int) -> None:
        """503 when admitting ``num_new`` more requests would exceed the waiting limit;
        429 when the request's tenant is over one of its limits (``tenants.py``).

        The count is kept here (requests without output yet) rather than read
        from the engine's scheduler stats, which are only refreshed by engine
        steps and so go stale when the engine falls idle.
        """
        if self.engine.errored:
            raise OpenAIError("the engine is dead; restart the server", status=503)
        waiting = self._num_not_started
        if self.max_waiting_requests is not None and (
            waiting + num_new > self.max_waiting_requests
        ):
            raise OpenAIError(
                f"server overloaded: {waiting} requests waiting "
                f"(--max-waiting-requests {self.max_waiting_requests}); retry later",
                status=503,
            )
        lease = current_lease.get()
        if lease is not None:
            lease.admit()

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        *,
        priority: int,
        delta: bool,
        fields: Mapping[str, str],
        prompt_param: str,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """``engine.generate`` with errors mapped to OpenAIError and admission bookkeeping.

        The request runs as its tenant (the HTTP request's lease), which is told
        of its tokens as they come.
        """
        lease = current_lease.get()
        tenant, tenant_weight = _tenant_of(lease)
        stream = self.engine.generate(
            prompt,
            params,
            request_id,
            priority=priority,
            delta=delta,
            lora_request=lora_request,
            trace_headers=trace_headers,
            tenant=tenant,
            tenant_weight=tenant_weight,
        )
        num_generated = 0
        in_use: AbstractContextManager[None] = (
            self.adapters.in_use(lora_request) if self.adapters is not None else nullcontext()
        )
        with in_use:
            async with aclosing(self._admitted(stream, fields, prompt_param)) as outputs:
                started = False
                async for output in outputs:
                    if lease is not None:
                        tokens = sum(len(out.token_ids) for out in output.outputs)
                        if not delta:  # cumulative outputs: count what is new
                            tokens, num_generated = tokens - num_generated, tokens
                        lease.on_output(0 if started else len(output.prompt_token_ids), tokens)
                    started = True
                    yield output

    async def encode(
        self,
        prompt: str | list[int],
        params: PoolingParams,
        request_id: str,
        *,
        priority: int,
        fields: Mapping[str, str],
        prompt_param: str,
    ) -> AsyncIterator[PoolingRequestOutput[PoolingOutput]]:
        """``engine.encode`` (a pooling request) with errors mapped to OpenAIError and
        admission bookkeeping. It runs as its tenant, whose limits its prompt tokens
        count against."""
        lease = current_lease.get()
        tenant, tenant_weight = _tenant_of(lease)
        stream = self.engine.encode(
            prompt,
            params,
            request_id,
            priority=priority,
            tenant=tenant,
            tenant_weight=tenant_weight,
        )
        async with aclosing(self._admitted(stream, fields, prompt_param)) as outputs:
            async for output in outputs:
                if lease is not None:
                    lease.on_output(len(output.prompt_token_ids), 0)
                yield output

    async def _admitted(
        self, stream: AsyncIterator[T], fields: Mapping[str, str], prompt_param: str
    ) -> AsyncGenerator[T]:
        """``stream``, counted as waiting until its first output; a ``ValueError``
        becomes a 400 naming the field (``prompt_param`` when it names none)."""
        self._num_not_started += 1
        started = False
        try:
            async for output in stream:
                if not started:
                    started = True
                    self._num_not_started -= 1
                yield output
        except ValueError as exc:
            raise from_value_error(exc, fields, prompt_param) from exc
        except EngineDeadError as exc:
            raise OpenAIError(f"the engine is dead: {exc}", status=500) from exc
        finally:
            if not started:
                self._num_not_started -= 1
            await _aclose(stream)

    async def until_ready(
        self,
        raw_request: Request,
        awaitables: Sequence[Awaitable[T]],
        streams: Sequence[AsyncIterator[Any]],
    ) -> list[T]:
        """Await all of ``awaitables`` (consuming ``streams``); on any failure close every stream.

        A client that disconnects meanwhile aborts the engine requests, and the
        handler answers 499 (nobody reads it).
        """
        try:
            return await unless_disconnected(raw_request, gather_or_cancel(awaitables))
        except BaseException:
            await aclose_all(streams)
            raise

    def token_str(self, token_id: int) -> str:
        """The text of a single token, as logprobs report it."""
        return self._token_str(token_id)

    def _decode_token(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    async def prompt_text(self, prompt: str | list[int]) -> str:
        """The prompt as text (for ``echo``); token ids are decoded off the event loop."""
        if isinstance(prompt, str):
            return prompt
        return await off_loop(lambda: str(self.tokenizer.decode(prompt)))


def _tenant_of(lease: TenantLease | None) -> tuple[str, float]:
    """The name and weight the engine schedules a request under ("" and 1: no lease)."""
    if lease is None:
        return "", 1.0
    return lease.tenant.name, lease.tenant.weight


# Characters JSON leaves raw but line splitters built on str.splitlines (httpx's
# aiter_lines, for one) end a line at: escaped, so an event's data stays one line.
_LINE_BREAKING = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: BaseModel | dict[str, Any], *, drop: Sequence[str] = ()) -> str:
    """One server-sent event holding ``payload`` as JSON, without the ``drop`` keys."""
    data = payload.model_dump() if isinstance(payload, BaseModel) else payload
    for key in drop:
        data.pop(key, None)
    text = json.dumps(data, ensure_ascii=False).translate(_LINE_BREAKING)
    return f"data: {text}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(exc: BaseException) -> str:
    """The error event a stream ends with when generation fails after the headers went out."""
    if isinstance(exc, OpenAIError):
        return sse(exc.body())
    return sse(OpenAIError(f"internal error: {exc!r}", status=500).body())


def finite_logprob(value: float | None) -> float:
    """A logprob fit for JSON: missing or non-finite becomes -9999.0, vLLM's placeholder."""
    return value if value is not None and math.isfinite(value) else -9999.0


def top_entries(logprobs: Mapping[int, float], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely (token id, logprob) pairs, best first."""
    return sorted(logprobs.items(), key=lambda item: item[1], reverse=True)[:k]
