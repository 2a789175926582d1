"""Which module class builds each supported architecture (``arch_families.FAMILIES``)."""

from __future__ import annotations

from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.model.arch_families import FAMILIES
from tokenloom.model.gemma import GemmaForCausalLM
from tokenloom.model.llama import CausalLM
from tokenloom.model.llava import LlavaForConditionalGeneration
from tokenloom.model.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

_DECODERS: dict[str, type[CausalLM]] = {
    "llama": CausalLM,
    "gemma": GemmaForCausalLM,
    "llava": LlavaForConditionalGeneration,
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
}


def model_class(arch: ModelArchConfig) -> type[CausalLM]:
    """The decoder class of the architecture's family."""
    return _DECODERS[FAMILIES[arch.architecture].decoder]
