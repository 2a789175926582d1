"""Llama-family causal LM (Llama, SmolLM, Mistral, Qwen2, Qwen3, Phi-3) over a paged
KV cache, and the base the other families (``gemma``) build on.

``CausalLM(arch, dtype)`` runs ``forward(input_ids [T], positions [T],
kv_caches, attn_metadata, keep_rows=None) -> hidden [T, hidden]`` on a flattened
ragged batch (see ``attention.AttentionMetadata``) and ``compute_logits(hidden
[N, hidden]) -> float32 [N, vocab]``. The final norm is applied in ``forward``;
``keep_rows`` (the rows the runner computes logits for) returns those rows
only, which lets the native decoder stack skip the rest of its last layer.

Q/K/V share one matmul (``qkv_proj``) and gate/up another (``gate_up_proj``).
``load_weights`` takes Hugging Face tensor names and splits them into those
fused parameters; the GGUF loader renames its tensors to the same names (and
Phi-3 checkpoints already use them).

What the families add is switched on by ``ModelArchConfig``: per-head q/k
RMSNorm (Qwen3), partial rotary embeddings and long-rope (Phi-3), per-layer
sliding windows (Mistral, Phi-3), a second RoPE table for sliding layers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Protocol, cast

import torch
from torch import nn

from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.model.attention import AttentionMetadata, paged_attention
from tokenloom.model.huge_pages import WeightArena
from tokenloom.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rope
from tokenloom.model.packed_linear import PackedLinear, prepack_linears
from tokenloom.model.panel_linear import DensePanels, PanelEmbedding, PanelLinear, pack_linears
from tokenloom.model.recipe import Op, Recipe, Step, attention_steps

KVCache = tuple[torch.Tensor, torch.Tensor]


class NativeDecoder(Protocol):
    """Every layer of a model as one call, for the steps it serves (the native
    decoder stack; the forward plan decides whether a model has one)."""

    def serves(self, meta: AttentionMetadata) -> bool: ...

    def __call__(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        keep_rows: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# The steps as globals, which DecoderLayer.forward's loop reads faster than
# enum attributes (it compares every step of every layer against them).
_ADD_NORM, _NORM, _QKV_PROJ, _QK_NORM = Op.ADD_NORM, Op.NORM, Op.QKV_PROJ, Op.QK_NORM
_ROPE, _ATTEND, _O_PROJ, _GATE_UP, _DOWN_PROJ = (
    Op.ROPE,
    Op.ATTEND,
    Op.O_PROJ,
    Op.GATE_UP,
    Op.DOWN_PROJ,
)


class Attention(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.rotary_dim = int(self.head_dim * arch.partial_rotary_factor)
        self.window = arch.layer_window(layer)
        self.scale = arch.attention_scale
        self.softcap = arch.attn_logit_softcapping
        self.qkv_proj = nn.Linear(
            arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias, dtype=dtype
        )
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False, dtype=dtype)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, dtype)
        # The forward plan's layer_ops and its kernels (see CausalLM.use_layer_ops).
        self.layer_ops = "torch"
        self.kernels: Any = None

    @property
    def takes_native_kernel(self) -> bool:
        """Whether the native attention kernel can compute this layer (no sliding
        window, no soft-capped scores); the other layers attend through torch."""
        return self.window is None and self.softcap is None

    def norm_qk(self, qkv: torch.Tensor) -> None:
        """Normalize each q and k head of ``qkv`` [T, q + k + v] in place."""
        assert self.q_norm is not None and self.k_norm is not None
        if self.layer_ops == "triton":
            self.kernels.qk_rms_norm(
                qkv,
                self.q_norm.weight,
                self.k_norm.weight,
                self.num_heads,
                self.num_kv_heads,
                self.q_norm.eps,
            )
            return
        qk = qkv[:, : self.q_size + self.kv_size].view(qkv.shape[0], -1, self.head_dim)
        qk[:, : self.num_heads] = self.q_norm(qk[:, : self.num_heads])
        qk[:, self.num_heads :] = self.k_norm(qk[:, self.num_heads :])

    def rope(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) from ``qkv``, q and k rotated
        (by the Triton kernel in place: q and k are then views of ``qkv``)."""
        num_tokens = qkv.shape[0]
        if self.layer_ops == "triton":
            heads = (self.num_heads, self.num_kv_heads, self.head_dim)
            cos, sin = cos.reshape(num_tokens, -1), sin.reshape(num_tokens, -1)
            self.kernels.rotary_qk(qkv, cos, sin, *heads)
            q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size]
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        elif self.layer_ops == "native" and self.rotary_dim == self.head_dim:
            q = qkv.new_empty(num_tokens, self.num_heads, self.head_dim)
            k = qkv.new_empty(num_tokens, self.num_kv_heads, self.head_dim)
            self.kernels.rotary_qk(q, k, qkv, cos.view(num_tokens, -1), sin.view(num_tokens, -1))
        else:
            qk = qkv[:, : self.q_size + self.kv_size].reshape(num_tokens, -1, self.head_dim)
            # Q and K rotate together: one RoPE call over H + Hkv heads.
            if self.rotary_dim == self.head_dim:
                qk = apply_rope(qk, cos, sin)
            else:
                rot = apply_rope(qk[..., : self.rotary_dim], cos, sin)
                qk = torch.cat((rot, qk[..., self.rotary_dim :]), dim=-1)
            q = qk[:, : self.num_heads]
            k = qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        return q, k, v

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Write this step's K/V into ``kv_cache``; the attention output [T, H * D]."""
        layer_meta = meta.for_layer(self.window, native=self.takes_native_kernel)
        return paged_attention(
            q, k, v, kv_cache[0], kv_cache[1], layer_meta, self.scale, self.softcap
        )


class DecoderLayer(nn.Module):
    """Runs its ``recipe`` (steps of ``recipe.Op``) with its modules. The native
    decoder stack is given the same recipe, so the order of operations is written
    there only."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = Attention(arch, dtype, layer)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, dtype, arch.hidden_act)
        self.recipe: Recipe = (
            Step(Op.ADD_NORM, "input_layernorm"),
            *attention_steps(arch.qk_norm),
            Step(Op.ADD_NORM, "post_attention_layernorm"),
            Step(Op.GATE_UP),
            Step(Op.DOWN_PROJ),
        )

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous layer's output, not yet added to ``residual`` (the residual
        stream; None at the first layer, where h is the embedding). Returns this
        layer's (output, residual stream), so each residual add is fused with the
        norm that follows it. The registers are ``recipe``'s; ``DecoderStack::forward``
        (csrc/decoder/decoder_stack.cpp) is the same switch in C++."""
        attn, mlp = self.self_attn, self.mlp
        x = h
        q = k = v = x  # until ROPE sets them
        for op, norm in self.recipe:
            if op is _ADD_NORM:
                if residual is None:
                    residual, x = x, self.norm(norm)(x)
                else:
                    x, residual = self.norm(norm).add_and_norm(x, residual)
            elif op is _NORM:
                x = self.norm(norm)(x)
            elif op is _QKV_PROJ:
                x = attn.qkv_proj(x)
            elif op is _QK_NORM:
                attn.norm_qk(x)
            elif op is _ROPE:
                q, k, v = attn.rope(x, cos, sin)
            elif op is _ATTEND:
                x = attn.attend(q, k, v, kv_cache, meta)
            elif op is _O_PROJ:
                x = attn.o_proj(x)
            elif op is _GATE_UP:
                x = mlp.activation(x)
            elif op is _DOWN_PROJ:
                x = mlp.down_proj(x)
            else:
                raise ValueError(f"unknown decoder step {op!r}")
        if residual is None:
            raise ValueError("a decoder recipe needs an add_norm step")
        return x, residual

    def norm(self, name: str | None) -> RMSNorm:
        """The RMSNorm a step names."""
        return cast(RMSNorm, getattr(self, cast(str, name)))


class CausalLM(nn.Module):
    """The whole decoder plus LM head; build it with ``loader.load_model``."""

    layer_class: type[nn.Module] = DecoderLayer

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.arch = arch
        # An explicit (uninitialised) weight: Embedding's own normal_() init on the meta
        # device imports torch._dynamo, resident memory spent for nothing.
        self.embed_tokens = nn.Embedding(
            arch.vocab_size,
            arch.hidden_size,
            _weight=torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype),
        )
        self.layers = nn.ModuleList(
            self.layer_class(arch, dtype, i) for i in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        rotary_dim = int(arch.head_dim * arch.partial_rotary_factor)
        self.rotary = RotaryEmbedding(
            rotary_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )
        # Sliding layers with their own RoPE base (Gemma 3) read a second table.
        self.local_rotary: RotaryEmbedding | None = None
        if arch.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(
                rotary_dim,
                arch.max_position_embeddings,
                arch.local_rope_theta,
                arch.local_rope_scaling,
            )
        self.uses_local_rotary = [
            self.local_rotary is not None and arch.layer_window(i) is not None
            for i in range(arch.num_hidden_layers)
        ]
        if arch.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False, dtype=dtype)
        # The packed head, or tensor parallelism's gathering one (distributed.parallel_layers).
        self.logits_head: nn.Module | None = None
        # The layers as one native call, for the steps it serves: set by the loader
        # where the forward plan says decoder=stack.
        self.decoder_stack: NativeDecoder | None = None

    def init_buffers(
        self, device: torch.device, dtype: torch.dtype, max_positions: int | None = None
    ) -> None:
        """Compute non-weight state (the RoPE tables, for ``max_positions`` positions
        when the served context is shorter than the model's) once the model sits on
        its device."""
        self.rotary.build_cache(device, dtype, max_positions)
        if self.local_rotary is not None:
            self.local_rotary.build_cache(device, dtype, max_positions)

    def cast_outside_matrices(self, dtype: torch.dtype) -> None:
        """Every parameter but the projections', the embedding's and the LM head's
        matrices in ``dtype`` (norms and biases, in the activations' dtype); on the
        meta device, before the weights load."""
        for module in self.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if name == "weight" and isinstance(module, (nn.Linear, nn.Embedding)):
                    continue
                setattr(module, name, nn.Parameter(param.to(dtype), requires_grad=False))

    def pack_weights(self) -> None:
        """Every matrix in panels for the native dense kernel (the forward plan's
        matmul=native on float weights, see ``panel_linear``), in its own dtype; the
        embedding gathers from the panels the LM head multiplies by when tied. All on
        huge pages (``huge_pages.WeightArena``), which a batch-1 step streams faster."""
        arena = WeightArena()
        pack_linears(self.layers, arena)
        embed = DensePanels.from_weight(self.embed_tokens.weight, arena)
        self.embed_tokens = PanelEmbedding(embed)  # type: ignore[assignment]
        head = (
            embed if self.lm_head is None else DensePanels.from_weight(self.lm_head.weight, arena)
        )
        self.logits_head = PanelLinear(head)
        if self.lm_head is not None:
            self.lm_head = self.logits_head  # type: ignore[assignment]

    def prepack_weights(self) -> None:
        """Run every matmul, the LM head included, on MKL-packed weights (the forward
        plan's matmul=mkl, see ``packed_linear``); the parameters stay as they are."""
        prepack_linears(self.layers)
        self.logits_head = PackedLinear(
            self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        )

    def use_layer_ops(self, choice: str) -> None:
        """Run RMSNorm (with its residual add; per q/k head), SiLU-and-mul and RoPE
        through the forward plan's layer_ops: ``native`` (the CPU kernels of
        ``csrc/layer_ops.cpp``), ``triton`` (``ops.cuda.layer_ops``) or ``torch``."""
        kernels: Any = None
        if choice == "native":
            kernels = torch.ops.tokenloom_cpu
        elif choice == "triton":
            # Imported here only: a process that never runs Triton does not load it.
            from tokenloom.ops.cuda import layer_ops

            kernels = layer_ops
        elif choice != "torch":
            raise ValueError(f"unknown layer_ops {choice!r}")
        for module in self.modules():
            if isinstance(module, (RMSNorm, GatedMLP, Attention)):
                module.kernels = kernels
            if isinstance(module, Attention):
                module.layer_ops = choice

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        keep_rows: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states [T, hidden], or those of rows ``keep_rows`` (int64).

        ``inputs_embeds`` [T, hidden] replaces the embedding of ``input_ids`` (a
        vision-language model's, with images in place); ``positions`` may be
        [3, T] for a model whose rotary embedding takes multimodal positions."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rotary.cos_sin(positions)
        if self.decoder_stack is not None and self.decoder_stack.serves(attn_metadata):
            return self.decoder_stack(h, cos, sin, kv_caches, attn_metadata, keep_rows)
        local_cos, local_sin = cos, sin
        if self.local_rotary is not None:
            local_cos, local_sin = self.local_rotary.cos_sin(positions)
        residual: torch.Tensor | None = None
        for layer, kv_cache, local in zip(
            self.layers, kv_caches, self.uses_local_rotary, strict=True
        ):
            c, s = (local_cos, local_sin) if local else (cos, sin)
            h, residual = layer(h, residual, c, s, kv_cache, attn_metadata)
        if keep_rows is not None:
            h = h.index_select(0, keep_rows)
            residual = None if residual is None else residual.index_select(0, keep_rows)
        if residual is None:
            return self.norm(h)
        return self.norm.add_and_norm(h, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_head is not None:
            logits = self.logits_head(hidden).float()
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = torch.nn.functional.linear(hidden, weight).float()
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ----- weight loading -------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into the (fused) parameters.

        Returns the names of the parameters filled (fused ones count once all
        their parts arrive), so the caller can report what is missing.
        """
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        needed: dict[str, int] = {}
        for hf_name, tensor in weights:
            target = self._map_name(hf_name)
            if target is None:
                continue
            name, offset, parts = target
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name} has no place in the model ({name})")
            param = params[name]
            dest = param.data if offset is None else param.data.narrow(0, offset, tensor.shape[0])
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"shape mismatch for {hf_name}: checkpoint {tuple(tensor.shape)}, "
                    f"model expects {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            filled[name] = filled.get(name, 0) + 1
            needed[name] = parts
        return {name for name, count in filled.items() if count >= needed[name]}

    def _map_name(self, hf_name: str) -> tuple[str, int | None, int] | None:
        """HF name -> (our parameter, row offset or None, parts it is split into)."""
        arch = self.arch
        if hf_name == "model.embed_tokens.weight":
            return "embed_tokens.weight", None, 1
        if hf_name == "model.norm.weight":
            return "norm.weight", None, 1
        if hf_name == "lm_head.weight":
            # Tied checkpoints sometimes carry a copy of the embedding: skip it.
            return None if arch.tie_word_embeddings else ("lm_head.weight", None, 1)
        match = _LAYER_NAME.match(hf_name)
        if match is None or "rotary_emb" in hf_name:
            return None  # old checkpoints carry rotary_emb.inv_freq buffers
        prefix, rest = f"layers.{match.group(1)}.", match.group(2)
        q_size = arch.num_attention_heads * arch.head_dim
        kv_size = arch.num_key_value_heads * arch.head_dim
        for proj, offset in (("q_proj", 0), ("k_proj", q_size), ("v_proj", q_size + kv_size)):
            if rest.startswith(f"self_attn.{proj}."):
                suffix = rest.rsplit(".", 1)[1]
                return f"{prefix}self_attn.qkv_proj.{suffix}", offset, 3
        if rest == "mlp.gate_proj.weight":
            return f"{prefix}mlp.gate_up_proj.weight", 0, 2
        if rest == "mlp.up_proj.weight":
            return f"{prefix}mlp.gate_up_proj.weight", arch.intermediate_size, 2
        return prefix + rest, None, 1
