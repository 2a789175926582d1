"""Write a random-weight checkpoint shaped like Llama-3.2-1B, in bfloat16, as a
Hugging Face directory both tokenloom and vLLM load (compare_peers.py's
``--hf-model`` / ``--tokenloom-model``).

The shapes, RoPE and tied head are Llama-3.2-1B's (hidden 2,048, 16 layers, 32
query and 8 KV heads of 64, MLP 8,192, vocabulary 128,256); the weights are
transformers' own random initialisation (normal, std 0.02), which is all a
speed comparison needs. The tokenizer is the default model's: its 49,152 ids
are valid inputs of the larger vocabulary, and the embedding rows past them are
zero, so no engine samples a token its tokenizer cannot decode (the head still
computes every row).

    .venv/bin/python benchmarks/peers/make_llama1b.py [--out .bench/llama1b-bf16]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenloom.default_model import default_model_path

LLAMA_3_2_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=True,
    hidden_act="silu",
)


def write(out: Path, seed: int) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = LlamaConfig(
        **LLAMA_3_2_1B,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)  # initialise in bf16: 2.5 GB, not 5
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[len(tokenizer) :] = 0
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(".bench/llama1b-bf16"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"wrote {write(args.out, args.seed)}")


if __name__ == "__main__":
    main()
