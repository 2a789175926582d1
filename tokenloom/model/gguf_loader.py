"""Dequantised weights from llama.cpp GGUF files.

``iter_gguf_weights(path, arch)`` yields ``(hf_name, float32 tensor)`` pairs,
so the model's ``load_weights`` serves GGUF and safetensors alike. Quantised
tensors (Q4_1, Q8_0, K-quants, ...) are dequantised with ``gguf.quants``.
``iter_gguf_tensors`` yields them as stored, for the quantized path
(``tokenloom.quantization``).

llama.cpp's converter permutes the rows of the Q and K projections of "llama"
models so that rotary pairs are interleaved (x0, x_{d/2}, x1, ...); we undo
it to get back the rotate-half layout. "qwen2" files are not permuted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

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


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as stored: block bytes still in the memory map, plus what it takes
    to turn them into our layout (rotate-half Q/K rows)."""

    raw: np.ndarray  # uint8 [*outer dims, bytes per row], in the file's memory map
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    rope_heads: int | None  # llama Q/K: un-interleave rows over this many heads

    def raw_rows(self) -> np.ndarray:
        """The bytes of each matrix row, in our row order (rows are independent
        blocks, so they can be reordered before dequantizing)."""
        if self.rope_heads is None:
            return self.raw
        return unpermute_rope_rows(self.raw, self.rope_heads)

    def dequantize(self) -> torch.Tensor:
        from gguf.quants import dequantize

        data = dequantize(self.raw, self.ggml_type).reshape(self.shape)
        # Copy out of the read-only memory map (torch wants writable arrays).
        data = np.require(data, np.float32, ["C", "W"])
        if self.rope_heads is not None:
            data = unpermute_rope_rows(data, self.rope_heads)
        return torch.from_numpy(np.require(data, np.float32, ["C", "W"]))


def iter_gguf_tensors(path: str | Path, arch: ModelArchConfig) -> Iterator[tuple[str, GGUFTensor]]:
    """(hf_name, stored tensor) for every tensor the model loads. Each tensor's
    bytes are valid until the next one is asked for: its pages then leave the
    resident set, and the file is unmapped when the iteration ends."""
    gguf_file = open_gguf(path)
    permute = gguf_file.metadata["general.architecture"] == "llama"
    with gguf_file.mapped() as data:
        for info in gguf_file.tensors:
            hf_name = gguf_to_hf_name(info.name)
            if hf_name is None:
                continue
            heads = None
            if permute and ".q_proj." in hf_name:
                heads = arch.num_attention_heads
            elif permute and ".k_proj." in hf_name:
                heads = arch.num_key_value_heads
            yield hf_name, GGUFTensor(data.raw(info), info.ggml_type, info.shape, heads)
            data.release(info)


def iter_gguf_weights(
    path: str | Path, arch: ModelArchConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    for hf_name, tensor in iter_gguf_tensors(path, arch):
        yield hf_name, tensor.dequantize()
