"""A quantized Llama decoder's layers as one native call per step
(``csrc/quantization/decoder_stack.cpp``).

At batch 1 most of a step was once Python and op dispatch around ~300 small
kernel calls; the stack runs the same kernels in the same order from C++, so its
output equals the modules' bit for bit. It serves the models whose layers are
exactly what it runs (quantized projections without bias, full rotate-half RoPE,
no q/k norms, sliding windows or soft-capping, SiLU MLP, native layer ops: the
Llama, SmolLM and Mistral-without-window GGUFs) and the steps the native
attention kernel takes whole (every request at most ``NATIVE_MAX_QUERY`` new
tokens: decodes, speculative verification, prompt chunks up to 512 tokens);
a step with a longer chunk runs through the modules.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn

from tokenloom.model.attention import AttentionMetadata
from tokenloom.model.llama import CausalLM, DecoderLayer, KVCache
from tokenloom.ops.cpu_kernels import layer_ops_available
from tokenloom.quantization.kernels import native_available
from tokenloom.quantization.linear import QuantLinear


def _projections(layer: DecoderLayer) -> tuple[nn.Module, ...]:
    """In the order the native stack takes them."""
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)


def _qualifies(model: CausalLM) -> bool:
    """Whether every layer is what the native stack computes."""
    if type(model) is not CausalLM or model.local_rotary is not None or not model.layers:
        return False
    for layer in model.layers:
        if type(layer) is not DecoderLayer:
            return False
        attn, mlp = layer.self_attn, layer.mlp
        if not all(type(p) is QuantLinear and p.bias is None for p in _projections(layer)):
            return False
        plain_attention = (
            attn.q_norm is None
            and attn.rotary_dim == attn.head_dim
            and attn.window is None
            and attn.softcap is None
        )
        norms = (layer.input_layernorm, layer.post_attention_layernorm, model.norm)
        fused = attn.fused_ops and mlp.fused_ops and all(n.fused_ops for n in norms)
        if not (plain_attention and fused and mlp.act == "silu"):
            return False
        if {n.eps for n in norms} != {model.norm.eps}:
            return False
    return True


class DecoderStack:
    """The native stack of one model; ``for_model`` builds it where it applies."""

    def __init__(self, model: CausalLM) -> None:
        layers = [cast(DecoderLayer, layer) for layer in model.layers]
        first = layers[0].self_attn
        scale = first.scale if first.scale is not None else 1.0 / math.sqrt(first.head_dim)
        self.stack = torch.classes.tokenloom_quant.DecoderStack(
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
            model.norm.eps,
            scale,
            model.norm.weight,
        )
        for layer in layers:
            self.stack.add_layer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight
            )
            for proj in _projections(layer):
                self.stack.add_matrix(*cast(QuantLinear, proj).qweight.kernel_args())

    @classmethod
    def for_model(cls, model: CausalLM) -> DecoderStack | None:
        """The stack for ``model``, or None where the modules must run (another
        layer structure, float weights, or no native kernels)."""
        if not (
            layer_ops_available(torch.device("cpu"), torch.float32)
            and native_available()
            and _qualifies(model)
        ):
            return None
        return cls(model)

    @staticmethod
    def serves(meta: AttentionMetadata) -> bool:
        """Whether the native attention kernel takes this step's whole batch."""
        return meta.native is not None and not meta.prefills and not meta.decode_groups

    def __call__(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        keep_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final norm's output for the embedded tokens ``h`` [T, hidden] (which it
        overwrites), or for rows ``keep_rows`` of them only (whose last layer alone
        it then computes); ``cos``, ``sin`` as ``RotaryEmbedding.cos_sin`` gives them."""
        native = meta.native
        assert native is not None
        num_tokens = h.shape[0]
        out: torch.Tensor = self.stack.forward(
            h,
            cos.view(num_tokens, -1),
            sin.view(num_tokens, -1),
            [cache[0] for cache in kv_caches],
            [cache[1] for cache in kv_caches],
            meta.slot_mapping,
            native.block_table,
            native.table_rows,
            native.query_start,
            native.query_len,
            native.seq_lens,
            keep_rows,
        )
        return out
