"""tokenloom: a small LLM inference and serving engine."""

from typing import TYPE_CHECKING, Any

from tokenloom.lora_request import LoRARequest
from tokenloom.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenloom.engine.llm import LLM

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "LoRARequest",
    "PoolingParams",
    "PoolingRequestOutput",
    "PoolingOutput",
    "EmbeddingRequestOutput",
    "EmbeddingOutput",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The engine is imported only when LLM is asked for, so core users stay light.
    if name == "LLM":
        from tokenloom.engine.llm import LLM

        return LLM
    raise AttributeError(name)
