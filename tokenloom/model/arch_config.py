"""The architecture of a checkpoint: shapes and constants, torch-free.

``arch_reader.load_arch_config(path)`` fills it from a Hugging Face
``config.json`` or a GGUF file's metadata; ``arch_families`` holds what each
family adds to the Llama layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenloom.multimodal.families import VisionArch

# "freq_factors" is llama.cpp's way of storing llama3 scaling: per-frequency divisors.
SUPPORTED_ROPE_TYPES = ("linear", "llama3", "freq_factors", "yarn", "dynamic", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelArchConfig:
    """Shapes and constants of a decoder-only Llama-family model."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    # Window of the sliding-window layers (the last ``sliding_window`` positions,
    # the query's own included); ``layer_windows[i]`` is layer i's window or None
    # for full attention (an empty tuple: every layer full).
    sliding_window: int | None = None
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 when set (Gemma),
    # else head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None
    partial_rotary_factor: float = 1.0  # share of head_dim that RoPE rotates
    # RoPE of the sliding-window layers when it differs from the global one (Gemma 3).
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    # The checkpoint stores q/k/v as one qkv_proj and gate/up as one gate_up_proj
    # (Phi-3): LoRA adapters then target the fused matrices.
    fused_checkpoint_projections: bool = False
    # Vision-language models: the vision tower and how images enter (None: text only),
    # and multimodal RoPE's split of the rotary frequencies over (time, height, width)
    # positions (Qwen2.5-VL; None: one position per token).
    vision: VisionArch | None = None
    mrope_section: tuple[int, ...] | None = None
    # The dtype config.json says the weights are stored in ("bfloat16", ...; its
    # "dtype" or older "torch_dtype"); None where it does not say, and for GGUF.
    checkpoint_dtype: str | None = None

    def layer_window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def attention_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return float(base) ** -0.5
