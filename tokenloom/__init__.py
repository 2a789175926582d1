"""tokenloom: a small LLM inference and serving engine."""

from tokenloom.outputs import CompletionOutput, RequestOutput
from tokenloom.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch; import it only when asked for, so core users stay light.
    if name == "LLM":
        from tokenloom.engine.llm import LLM

        return LLM
    raise AttributeError(name)
