"""Which module class builds each supported architecture."""

from __future__ import annotations

from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.model.gemma import GemmaForCausalLM
from tokenloom.model.llama import CausalLM

_CLASSES: dict[str, type[CausalLM]] = {
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}


def model_class(arch: ModelArchConfig) -> type[CausalLM]:
    """The Llama-family ``CausalLM`` (Llama, Mistral, Qwen2, Qwen3, Phi-3) unless the
    family needs its own layers."""
    return _CLASSES.get(arch.architecture, CausalLM)
