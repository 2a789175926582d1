"""Llama-family causal LM (Llama, SmolLM, Mistral, Qwen2) over a paged KV cache.

``CausalLM(arch, dtype)`` runs ``forward(input_ids [T], positions [T],
kv_caches, attn_metadata) -> hidden [T, hidden]`` on a flattened ragged batch
(see ``attention.AttentionMetadata``) and ``compute_logits(hidden [N, hidden])
-> float32 [N, vocab]``. The final norm is applied in ``forward``, so the runner
may pick any rows of ``hidden`` before computing logits.

Q/K/V share one matmul (``qkv_proj``) and gate/up another (``gate_up_proj``).
``load_weights`` takes Hugging Face tensor names and splits them into those
fused parameters; the GGUF loader renames its tensors to the same names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.model.attention import AttentionMetadata, paged_attention
from tokenloom.model.layers import RMSNorm, RotaryEmbedding, SiluMLP, apply_rope
from tokenloom.model.packed_linear import PackedLinear, prepack_linears

KVCache = tuple[torch.Tensor, torch.Tensor]
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class Attention(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias, dtype=dtype
        )
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False, dtype=dtype)
        self.fused_ops = False  # RoPE by the native kernel (see CausalLM.use_fused_layer_ops)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.fused_ops:
            q = qkv.new_empty(num_tokens, self.num_heads, self.head_dim)
            k = qkv.new_empty(num_tokens, self.num_kv_heads, self.head_dim)
            torch.ops.tokenloom_cpu.rotary_qk(
                q, k, qkv, cos.view(num_tokens, -1), sin.view(num_tokens, -1)
            )
        else:
            # Q and K rotate together: one RoPE call over H + Hkv heads.
            qk = apply_rope(
                qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim), cos, sin
            )
            q = qk[:, : self.num_heads]
            k = qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = Attention(arch, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = SiluMLP(arch.hidden_size, arch.intermediate_size, dtype)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous layer's MLP output, not yet added to ``residual`` (the
        residual stream; None at the first layer, where h is the embedding). Returns
        this layer's (MLP output, residual stream), so each residual add is fused
        with the norm that follows it."""
        if residual is None:
            residual = h
            x = self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.add_and_norm(h, residual)
        x = self.self_attn(x, cos, sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


class CausalLM(nn.Module):
    """The whole decoder plus LM head; build it with ``loader.load_model``."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, dtype) for _ in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )
        if arch.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False, dtype=dtype)
        self.logits_head: PackedLinear | None = None

    def init_buffers(self, device: torch.device, dtype: torch.dtype) -> None:
        """Compute non-weight state (the RoPE table) once the model sits on its device."""
        self.rotary.build_cache(device, dtype)

    def prepack_weights(self) -> None:
        """Run every matmul, the LM head included, on MKL-packed weights (CPU, float32:
        see ``packed_linear``); the parameters stay as they are."""
        prepack_linears(self.layers)
        self.logits_head = PackedLinear(
            self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        )

    def use_fused_layer_ops(self) -> None:
        """Run RMSNorm (with its residual add), SiLU-and-mul and RoPE through the
        native CPU kernels (float32 on CPU: ``cpu_kernels.layer_ops_available``)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, SiluMLP, Attention)):
                module.fused_ops = True

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, cos, sin, kv_cache, attn_metadata)
        if residual is None:
            return self.norm(h)
        return self.norm.add_and_norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_head is not None:
            return self.logits_head(hidden).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()

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
