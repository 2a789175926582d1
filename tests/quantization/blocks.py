"""Random GGUF blocks and tiny random-weight GGUF files of any supported type."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from tokenloom.quantization.formats import GroupFactors, QuantizedWeight

# Byte offsets of the fp16 scale fields in each block (the rest is codes), and
# the largest |code * sub-scale| a weight can reach per unit of those scales.
_F16_FIELDS = {
    T.Q8_0: ((0,), 127),
    T.Q4_0: ((0,), 8),
    T.Q4_1: ((0, 2), 15),
    T.Q4_K: ((0, 2), 63 * 15),
    T.Q5_K: ((0, 2), 63 * 31),
    T.Q6_K: ((208,), 128 * 32),
}


def random_gguf(ggml_type: T, n: int, k: int, seed: int = 0, magnitude: float = 0.1) -> np.ndarray:
    """Random blocks of ``ggml_type`` for an [n, k] matrix whose weights stay within
    about ``magnitude``, as uint8 [n, bytes per row]."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    offsets, reach = _F16_FIELDS[ggml_type]
    for offset in offsets:
        scale = (rng.uniform(0.3, 1.0, (n, k // block)) * magnitude / reach).astype(np.float16)
        blocks[..., offset : offset + 2] = scale[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


# Every (bits, group, with_mins) the native kernel's layouts take.
LAYOUTS = [
    (4, 32, True),
    (4, 32, False),
    (6, 32, True),
    (6, 32, False),
    (6, 16, True),
    (6, 16, False),
    (8, 32, False),
    (8, 32, True),
    (8, 16, False),
    (8, 16, True),
]


def random_factors(
    n: int, groups: int, form: str, magnitude: float, gen: torch.Generator
) -> GroupFactors:
    """``form``: float32 or float16 per group, or an fp16 base per ``groups`` (one
    super-block per row) times int8 codes over their full range."""
    if form == "coded":
        base = (torch.rand(n, 1, generator=gen) * magnitude / 64).half()
        codes = torch.randint(-128, 128, (n, groups), generator=gen, dtype=torch.int8)
        return GroupFactors(base, codes)
    values = torch.rand(n, groups, generator=gen) * magnitude
    return GroupFactors(values.half() if form == "float16" else values)


def random_layout(
    bits: int, group: int, with_mins: bool, form: str, n: int, k: int, gen: torch.Generator
) -> QuantizedWeight:
    """An [n, k] weight of random codes over their full range (int8 -128..127, 4
    bits 0..15, 6 bits 0..63), zero padding past K, and random scales (and
    negative mins) stored as ``form`` (see ``random_factors``)."""
    k_pad = -(-k // 32) * 32
    qhigh = None
    if bits == 8:
        qweight = torch.randint(-128, 128, (n, k_pad), generator=gen, dtype=torch.int8)
    else:
        qweight = torch.randint(0, 256, (n, k_pad // 2), generator=gen, dtype=torch.uint8)
    if bits == 6:
        qhigh = torch.randint(0, 256, (n, k_pad // 4), generator=gen, dtype=torch.uint8)
    scales = random_factors(n, k_pad // group, form, 0.02, gen)
    mins = None
    if with_mins:
        mins = random_factors(n, k_pad // group, form, 0.1, gen)
        mins.base = -mins.base
    return QuantizedWeight(bits, group, k, qweight, scales, mins, qhigh)


class LlamaShape(NamedTuple):
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int


# A tiny llama: K-quants need 256-column rows, so hidden 256 and FFN 512.
TINY = LlamaShape(hidden=256, ffn=512, layers=2, heads=4, kv_heads=2, vocab=512)


def write_tiny_gguf(
    path: Path, types: dict[str, T], tied: bool = True, seed: int = 0, shape: LlamaShape = TINY
) -> None:
    """A random-weight llama GGUF (of ``shape``); ``types`` maps each matrix's GGUF
    base name (attn_q, ..., ffn_down, token_embd, output) to its quantized type."""
    HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = shape  # noqa: N806
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(8192)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    rng = np.random.default_rng(seed)
    kv = HIDDEN // HEADS * KV_HEADS
    shapes = {
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (kv, HIDDEN),
        "attn_v": (kv, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }

    def matrix(name: str, base: str, rows_cols: tuple[int, int], magnitude: float = 0.1) -> None:
        seed = int(rng.integers(1 << 30))
        raw = random_gguf(types[base], *rows_cols, seed=seed, magnitude=magnitude)
        writer.add_tensor(name, raw, raw_dtype=types[base])

    # Embedding and head weights up to 0.3: logits then span tens of nats
    # (perplexity 1e5-1e7 on text). At 1.0 they spanned hundreds (perplexity 3e16),
    # where 1% of perplexity is 0.01 nats out of 38 and the native kernel's int8
    # activations (~0.5% noise per logit, as llama.cpp's) alone moved it by 1.7%.
    matrix("token_embd.weight", "token_embd", (VOCAB, HIDDEN), magnitude=0.3)
    for layer in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(HIDDEN, np.float32))
        for base, rows_cols in shapes.items():
            matrix(f"blk.{layer}.{base}.weight", base, rows_cols)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    if not tied:
        matrix("output.weight", "output", (VOCAB, HIDDEN), magnitude=0.3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
