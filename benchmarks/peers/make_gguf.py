"""Write random-weight GGUF files of real model shapes, to measure memory and speed
at the sizes users run (not for quality: the weights are noise).

- ``llama-1b``: Llama-3.2-1B's shape (16 layers, hidden 2048, MLP 8192, 32/8
  heads of 64, vocab 128256, tied embedding) in Q4_K_M's types as llama.cpp's
  quantizer assigns them: Q4_K matrices, Q6_K for attn_v and ffn_down in the
  first and last eighth of the layers and every third layer between, Q6_K for
  the embedding (it is also the output head), F32 norms.
- ``llama-8b``: Llama-3.1-8B's shape (32 layers, hidden 4096, MLP 14336, 32/8
  heads of 128, vocab 128256, untied) in Q4_0, with a Q6_K output head (as
  llama.cpp's Q4_0 files have).

Quantized blocks are random bytes with their fp16 scales overwritten by small
finite values, so every weight is a valid, bounded number and the files
dequantize to what a real file of that type would hold in structure. The
tokenizer is the bundled SmolLM2 GGUF's (GPT-2 BPE), its vocabulary padded with
unused tokens to 128256 so the embedding and head have the real shape. The
padding tokens are plain vocabulary entries (no merge produces them), as
Llama 3's 128000 BPE tokens are: typed as added (user-defined) tokens, 79k of
them made the Hugging Face tokenizer alone take 250 MB, which a real Llama-3
tokenizer (256 added tokens) does not.
Tensors are streamed to disk one at a time (the 8B file is ~4.6 GB).

    .venv/bin/python benchmarks/peers/make_gguf.py llama-1b llama-8b   # -> .bench/gguf/
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    rope_theta: float
    context: int


SHAPES = {
    "llama-1b": Shape(16, 2048, 8192, 32, 8, 128256, True, 500000.0, 131072),
    "llama-8b": Shape(32, 4096, 14336, 32, 8, 128256, False, 500000.0, 131072),
}

# Byte offsets of the fp16 scale fields in one block, and the magnitude to give them.
_SCALES = {
    Q.Q4_0: ((0,), 0.004),
    Q.Q8_0: ((0,), 0.0005),
    Q.Q4_K: ((0, 2), 0.0005),  # d, dmin
    Q.Q6_K: ((208,), 0.0002),  # d after ql, qh, scales
}


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: Q4_K_M spends Q6_K on these layers' attn_v/ffn_down."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_plan(name: str, s: Shape) -> list[tuple[str, tuple[int, int] | tuple[int], Q]]:
    """(name, shape as [rows, cols] or [n], type) of every tensor, in file order."""
    one_b = name == "llama-1b"
    q_main = Q.Q4_K if one_b else Q.Q4_0
    hd = s.hidden // s.heads
    plan: list[tuple[str, tuple[int, int] | tuple[int], Q]] = [
        ("token_embd.weight", (s.vocab, s.hidden), Q.Q6_K if one_b else Q.Q4_0)
    ]
    for i in range(s.layers):
        wide = Q.Q6_K if one_b and _more_bits(i, s.layers) else q_main
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", (s.hidden,), Q.F32),
            (p + "attn_q.weight", (s.heads * hd, s.hidden), q_main),
            (p + "attn_k.weight", (s.kv_heads * hd, s.hidden), q_main),
            (p + "attn_v.weight", (s.kv_heads * hd, s.hidden), wide),
            (p + "attn_output.weight", (s.hidden, s.heads * hd), q_main),
            (p + "ffn_norm.weight", (s.hidden,), Q.F32),
            (p + "ffn_gate.weight", (s.intermediate, s.hidden), q_main),
            (p + "ffn_up.weight", (s.intermediate, s.hidden), q_main),
            (p + "ffn_down.weight", (s.hidden, s.intermediate), wide),
        ]
    plan.append(("output_norm.weight", (s.hidden,), Q.F32))
    if not s.tied:
        plan.append(("output.weight", (s.vocab, s.hidden), Q.Q6_K))
    return plan


def random_tensor(
    shape: tuple[int, int] | tuple[int], qtype: Q, rng: np.random.Generator
) -> np.ndarray:
    """Random data of ``qtype``: float32 for F32, else uint8 [rows, bytes per row]."""
    if qtype == Q.F32:
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    rows, cols = shape  # type: ignore[misc]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert cols % block == 0, (shape, qtype)
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    offsets, magnitude = _SCALES[qtype]
    for off in offsets:
        scale = (magnitude * (0.5 + rng.random(blocks.shape[0]))).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block * size)


def copy_tokenizer(writer: gguf.GGUFWriter, vocab: int) -> None:
    """The bundled model's tokenizer metadata, its vocabulary padded to ``vocab``."""
    sys.path.insert(0, str(ROOT))
    from tokenloom.default_model import default_model_path

    reader = gguf.GGUFReader(str(default_model_path()))
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    tokens = list(fields.pop("tokenizer.ggml.tokens"))
    types = list(fields.pop("tokenizer.ggml.token_type"))
    pad = vocab - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(pad)]
    types += [int(gguf.TokenType.NORMAL)] * pad
    writer.add_tokenizer_model(fields.pop("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(fields.pop("tokenizer.ggml.pre"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(fields.pop("tokenizer.ggml.merges")))
    writer.add_bos_token_id(int(fields.pop("tokenizer.ggml.bos_token_id")))
    writer.add_eos_token_id(int(fields.pop("tokenizer.ggml.eos_token_id")))
    writer.add_unk_token_id(int(fields.pop("tokenizer.ggml.unknown_token_id")))
    writer.add_pad_token_id(int(fields.pop("tokenizer.ggml.padding_token_id")))
    writer.add_add_bos_token(bool(fields.pop("tokenizer.ggml.add_bos_token")))
    writer.add_add_space_prefix(bool(fields.pop("tokenizer.ggml.add_space_prefix")))
    writer.add_chat_template(fields.pop("tokenizer.chat_template"))


def write(name: str, out: Path, seed: int = 0) -> Path:
    s = SHAPES[name]
    path = out / f"{name}-random-{'Q4_K_M' if name == 'llama-1b' else 'Q4_0'}.gguf"
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"random {name}")
    writer.add_block_count(s.layers)
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.intermediate)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(s.vocab)
    writer.add_rope_dimension_count(s.hidden // s.heads)
    writer.add_file_type(
        gguf.LlamaFileType.MOSTLY_Q4_K_M if name == "llama-1b" else gguf.LlamaFileType.MOSTLY_Q4_0
    )
    copy_tokenizer(writer, s.vocab)
    plan = tensor_plan(name, s)
    for tname, shape, qtype in plan:
        if qtype == Q.F32:
            writer.add_tensor_info(tname, shape, np.dtype(np.float32), shape[0] * 4)
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            rows, cols = shape  # type: ignore[misc]
            byte_shape = (rows, cols // block * size)
            writer.add_tensor_info(
                tname, byte_shape, np.dtype(np.uint8), rows * cols // block * size, raw_dtype=qtype
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _tname, shape, qtype in plan:
        writer.write_tensor_data(random_tensor(shape, qtype, rng))
    writer.close()
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="+", choices=sorted(SHAPES))
    ap.add_argument("--out", type=Path, default=ROOT / ".bench" / "gguf")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.shapes:
        path = write(name, args.out)
        print(f"{path}: {path.stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
