"""Gemma 2 and Gemma 3 text models, on the Llama family's attention and MLP.

What differs from ``llama``:
- embeddings are multiplied by sqrt(hidden_size) (rounded to the model dtype);
- each sublayer is wrapped in two norms (input/post-attention around attention,
  pre/post-feedforward around the MLP) and the MLP is GeGLU (tanh GELU);
- RMSNorm multiplies by (1 + weight): the 1 is added once, when loading;
- attention scores are scaled by ``query_pre_attn_scalar ** -0.5``; Gemma 2
  soft-caps them (``attn_logit_softcapping``) and the final logits
  (``final_logit_softcapping``);
- sliding-window layers interleave with global ones (every other layer in
  Gemma 2, five of six in Gemma 3, whose sliding layers also use their own RoPE
  base and whose q/k are RMS-normalised per head).
All of these but the norms' placement (the layer's recipe), the embedding scale
and the norm offset are ``ModelArchConfig`` switches that ``llama.Attention`` and
``CausalLM`` read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.model.layers import RMSNorm
from tokenloom.model.llama import CausalLM, DecoderLayer
from tokenloom.model.recipe import Op, Step, attention_steps


class GemmaDecoderLayer(DecoderLayer):
    """Llama's layer with a norm after each sublayer as well as before."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__(arch, dtype, layer)
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, dtype)
        self.recipe = (
            Step(Op.ADD_NORM, "input_layernorm"),
            *attention_steps(arch.qk_norm),
            Step(Op.NORM, "post_attention_layernorm"),
            Step(Op.ADD_NORM, "pre_feedforward_layernorm"),
            Step(Op.GATE_UP),
            Step(Op.DOWN_PROJ),
            Step(Op.NORM, "post_feedforward_layernorm"),
        )


class GemmaForCausalLM(CausalLM):
    layer_class = GemmaDecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        return h * torch.tensor(self.arch.hidden_size**0.5, dtype=h.dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_offset_norms(weights))


def _offset_norms(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Gemma's RMSNorm scales by (1 + weight); store that sum as the weight."""
    for name, tensor in weights:
        if name.endswith("norm.weight"):
            tensor = tensor.float() + 1.0
        yield name, tensor
