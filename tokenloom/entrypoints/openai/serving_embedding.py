"""POST /v1/embeddings: one pooled vector per input, on an engine run with ``--runner pooling``.

Each input is one engine request: prefilled (in chunks when long, batched with
the others, from the prefix cache where its pooling allows) and finished with
its pooled vector. ``encoding_format: base64`` sends the engine's float32
bytes as they are; ``float`` sends them as numbers.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

from fastapi import Request
from fastapi.responses import Response

from tokenloom.outputs import PoolingOutput, PoolingRequestOutput
from tokenloom.pooling_params import PoolingParams

from .errors import OpenAIError, from_value_error
from .protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, UsageInfo
from .serving_base import OpenAIServing, json_response, last_output, new_request_id

# The engine's messages start with these names; "prompt" ones blame ``input``.
_FIELDS = {name: name for name in ("dimensions", "normalize", "truncate_prompt_tokens", "priority")}


class OpenAIServingEmbedding:
    """Turns an EmbeddingRequest into engine pooling requests (one per input) and back."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        serving = self.serving
        if serving.check_model(request.model) is not None:
            raise OpenAIError("LoRA adapters do not serve embeddings", param="model")
        try:
            params = PoolingParams(
                dimensions=request.dimensions,
                normalize=request.normalize,
                truncate_prompt_tokens=request.truncate_prompt_tokens,
            )
        except ValueError as exc:
            raise from_value_error(exc, _FIELDS, None) from exc
        inputs = request.inputs()
        serving.check_capacity(len(inputs))
        request_id = new_request_id("embd")
        streams = [
            serving.encode(
                item,
                params,
                f"{request_id}-{i}",
                priority=request.priority,
                fields=_FIELDS,
                prompt_param="input",
            )
            for i, item in enumerate(inputs)
        ]
        finals = await serving.until_ready(raw_request, [last_output(s) for s in streams], streams)
        return await json_response(lambda: self._response(request, request_id, finals))

    def _response(
        self,
        request: EmbeddingRequest,
        request_id: str,
        finals: Sequence[PoolingRequestOutput[PoolingOutput]],
    ) -> EmbeddingResponse:
        data = []
        for index, final in enumerate(finals):
            if not final.outputs.raw:  # ended without its vector (aborted in the engine)
                raise OpenAIError("the engine returned no embedding", status=500)
            embedding: list[float] | str
            if request.encoding_format == "base64":
                embedding = base64.b64encode(final.outputs.raw).decode("ascii")
            else:
                embedding = final.outputs.data
            data.append(EmbeddingData(index=index, embedding=embedding))
        prompt_tokens = sum(len(final.prompt_token_ids) for final in finals)
        return EmbeddingResponse(
            id=request_id,
            model=self.serving.model_name,
            data=data,
            usage=UsageInfo.of(prompt_tokens, 0),
        )
