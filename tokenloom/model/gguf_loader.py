"""Dequantised weights from llama.cpp GGUF files.

``iter_gguf_weights(path, arch)`` yields ``(hf_name, float32 tensor)`` pairs,
so the model's ``load_weights`` serves GGUF and safetensors alike. Quantised
tensors (Q4_1, Q8_0, K-quants, ...) are dequantised with ``gguf.quants``.

llama.cpp's converter permutes the rows of the Q and K projections of "llama"
models so that rotary pairs are interleaved (x0, x_{d/2}, x1, ...); we undo
it to get back the rotate-half layout. "qwen2" files are not permuted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.model.gguf_reader import open_gguf

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_to_hf_name(name: str) -> str | None:
    """GGUF tensor name -> Hugging Face name; None for tensors we do not load."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK.match(name)
    if match is None:
        return None  # rope_freqs.weight is read into the arch config instead
    layer, rest = match.groups()
    base, _, suffix = rest.rpartition(".")
    if base not in _BLOCK_NAMES:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    return f"model.layers.{layer}.{_BLOCK_NAMES[base]}.{suffix}"


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleaving (works for weights and biases)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def iter_gguf_weights(
    path: str | Path, arch: ModelArchConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    gguf_file = open_gguf(path)
    permute = gguf_file.metadata["general.architecture"] == "llama"
    for info in gguf_file.tensors:
        hf_name = gguf_to_hf_name(info.name)
        if hf_name is None:
            continue
        data = dequantize(gguf_file.raw_tensor(info), info.ggml_type).reshape(info.shape)
        # Copy out of the read-only memory map (torch wants writable arrays).
        data = np.require(data, np.float32, ["C", "W"])
        if permute and ".q_proj." in hf_name:
            data = unpermute_rope_rows(data, arch.num_attention_heads)
        elif permute and ".k_proj." in hf_name:
            data = unpermute_rope_rows(data, arch.num_key_value_heads)
        yield hf_name, torch.from_numpy(np.require(data, np.float32, ["C", "W"]))
