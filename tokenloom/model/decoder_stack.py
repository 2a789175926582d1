"""A decoder's layers as one native call per step (``csrc/decoder/decoder_stack.cpp``),
over any weights whose projections have a native kernel: quantized panels
(``quantization.linear.QuantLinear``) or float ones (``panel_linear.PanelLinear``).

The stack is given the layers' recipe (``DecoderLayer.recipe``) by step name and
each projection as a native object (``PanelProjection.native_projection``), and
runs the recipe in C++ with the kernels the modules call, so its output equals
theirs bit for bit. It computes models whose layers share one recipe of steps it
implements, with projections without bias, full rotate-half RoPE, no sliding
windows or soft-capped scores, a SiLU MLP and one norm epsilon
(``DecoderStack.refusal`` names what else a model has); it needs the native
matmul, layer ops and attention kernel, and serves the steps that kernel takes
whole (every request at most ``NATIVE_MAX_QUERY`` new tokens: decodes,
speculative verification, short prompt chunks). Whether a model gets one is the
forward plan's decision (``model_loader.forward_plan``); the other steps run
through the modules.
"""

from __future__ import annotations

import functools
import math
from typing import cast

import torch

from tokenloom.model.attention import AttentionMetadata
from tokenloom.model.llama import CausalLM, DecoderLayer, KVCache
from tokenloom.model.panel_linear import PanelProjection
from tokenloom.model.recipe import PROJECTIONS
from tokenloom.ops.native_library import kernels_enabled, load_library


@functools.cache
def implemented_steps() -> frozenset[str]:
    """The recipe steps the native stack implements, by name."""
    return frozenset(torch.ops.tokenloom_cpu.decoder_stack_steps())


# Steps of at least this many decodes run as two micro-batches, one's attention
# beside the other's projections (``DecoderStack::forward_split``): in steps
# alternating with the whole batch, 32 to 128 decodes took 0.93-1.00x the time
# and 24 took 1.09x (docs/benchmarks.md).
OVERLAP_MIN_DECODES = 32
# ... where a layer's projections are at most this many bytes: the second
# micro-batch re-reads them from L3 (32 MB on the Zen 4 measured), where a
# larger layer would come from DRAM twice a step.
OVERLAP_MAX_LAYER_BYTES = 16 << 20


class DecoderStack:
    """The native stack of one model, whose layers it must compute (``refusal``).
    ``overlap_decodes_from``: the fewest decodes a step runs as two micro-batches
    (0: never), by default as the model's layer size allows."""

    def __init__(self, model: CausalLM, overlap_decodes_from: int | None = None) -> None:
        refusal = self.refusal(model)
        if refusal is not None:
            raise ValueError(f"the decoder stack cannot compute this model: {refusal}")
        layers = [cast(DecoderLayer, layer) for layer in model.layers]
        recipe = layers[0].recipe
        first = layers[0].self_attn
        scale = first.scale if first.scale is not None else 1.0 / math.sqrt(first.head_dim)
        self.stack = torch.classes.tokenloom_cpu.DecoderStack(
            [step.op.value for step in recipe],
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
            model.norm.eps,
            scale,
            model.norm.weight,
        )
        for layer in layers:
            self.stack.add_layer([layer.norm(step.norm).weight for step in recipe if step.norm])
            for step in recipe:
                if step.op in PROJECTIONS:
                    proj = layer.get_submodule(PROJECTIONS[step.op])
                    if not isinstance(proj, PanelProjection):
                        raise ValueError(
                            f"the decoder stack needs native projections; "
                            f"{PROJECTIONS[step.op]} is a {type(proj).__name__}"
                        )
                    self.stack.add_projection(proj.native_projection())
        if overlap_decodes_from is None:
            layer_bytes = sum(
                cast(PanelProjection, layers[0].get_submodule(name)).weight_bytes
                for name in PROJECTIONS.values()
            )
            small = layer_bytes <= OVERLAP_MAX_LAYER_BYTES
            overlap_decodes_from = OVERLAP_MIN_DECODES if small else 0
        self.stack.overlap_decodes_from(overlap_decodes_from)

    @staticmethod
    def refusal(model: CausalLM) -> str | None:
        """Why the stack cannot compute ``model``'s layers (its projections aside, which
        the forward plan's matmul decides), or None where it can. Asks only the
        model's structure: it answers on the meta device, before the weights load."""
        if not kernels_enabled() or load_library() is None:
            return "the native kernels are unavailable"
        layers = [cast(DecoderLayer, layer) for layer in model.layers]
        if not layers:
            return "the model has no layers"
        if model.local_rotary is not None:
            return "its sliding layers have a RoPE table of their own"
        recipe = layers[0].recipe
        missing = [step.op.value for step in recipe if step.op.value not in implemented_steps()]
        if missing:
            return f"its layers have a {missing[0]!r} step, which the stack does not implement"
        eps = {model.norm.eps}
        for i, layer in enumerate(layers):
            if layer.recipe != recipe:
                return f"layer {i}'s recipe differs from layer 0's"
            for step in recipe:
                if step.op in PROJECTIONS:
                    proj = layer.get_submodule(PROJECTIONS[step.op])
                    if getattr(proj, "bias", None) is not None:
                        return f"layer {i}'s {PROJECTIONS[step.op]} has a bias"
                if step.norm:
                    eps.add(layer.norm(step.norm).eps)
            attn = layer.self_attn
            if attn.rotary_dim != attn.head_dim:
                return "it rotates part of each head only"
            if not attn.takes_native_kernel:
                return f"layer {i} has a sliding window or soft-capped scores"
            if layer.mlp.act != "silu":
                return f"its MLP's activation is {layer.mlp.act}, not silu"
        if len(eps) > 1:
            return "its norms differ in epsilon"
        return None

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
