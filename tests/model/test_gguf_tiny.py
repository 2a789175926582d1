"""Tiny GGUF files written here from random HF models, the way llama.cpp's
converter lays them out (Q/K rows interleaved for "llama", not for "qwen2"),
must load into the same logits; quantised tensors must dequantise."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from tests.model.scenario import BLOCK_SIZE, make_sequences, max_abs_diff, run_scenario
from tests.model.test_llama_hf import COMMON, VOCAB, _random_hf_model, _reference_logits
from tokenloom.config import ModelConfig
from tokenloom.model.arch_reader import load_arch_config
from tokenloom.model.gguf_loader import unpermute_rope_rows
from tokenloom.model.kv_cache import allocate_kv_caches
from tokenloom.model_loader.loader import load_model

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to Q/K rows of llama models."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(hf_model: torch.nn.Module, arch: str, path: Path) -> None:
    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in hf_model.state_dict().items():
        w = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gguf_name = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            base, suffix = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_HF_TO_GGUF[base]}.{suffix}"
            if arch == "llama" and base == "self_attn.q_proj":
                w = llama_cpp_permute(w, cfg.num_attention_heads)
            elif arch == "llama" and base == "self_attn.k_proj":
                w = llama_cpp_permute(w, cfg.num_key_value_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(6 * 16 * 3, dtype=np.float32).reshape(6 * 16, 3)
    assert not np.array_equal(llama_cpp_permute(w, 6), w)
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(w, 6), 6), w)


@pytest.mark.parametrize(
    "arch,config",
    [
        ("llama", LlamaConfig(**COMMON, tie_word_embeddings=True)),
        ("llama", LlamaConfig(**COMMON, tie_word_embeddings=False)),
        ("qwen2", Qwen2Config(**COMMON, tie_word_embeddings=False)),
    ],
)
def test_tiny_gguf_matches_transformers(arch: str, config, tmp_path: Path) -> None:
    hf_model = _random_hf_model(config, seed=11)
    path = tmp_path / "tiny.gguf"
    write_gguf(hf_model, arch, path)
    parsed = load_arch_config(path)
    assert parsed.attention_bias == (arch == "qwen2")
    assert parsed.tie_word_embeddings == config.tie_word_embeddings
    assert (parsed.num_key_value_heads, parsed.head_dim, parsed.vocab_size) == (2, 16, VOCAB)
    assert parsed.eos_token_ids == [2] and parsed.bos_token_id == 1

    loaded = load_model(ModelConfig(model=str(path), dtype="float32"))
    kv = allocate_kv_caches(loaded.arch, 32, BLOCK_SIZE, loaded.dtype, "cpu")
    seqs = make_sequences(VOCAB, seed=2)
    diff = max_abs_diff(run_scenario(loaded.model, kv, seqs), _reference_logits(hf_model, seqs))
    assert diff < 1e-4, f"{arch}: max |logit diff| {diff:.2e}"


def test_quantised_tensor_is_dequantised(tmp_path: Path) -> None:
    """A Q8_0 matrix in the file loads as its dequantised values."""
    hf_model = _random_hf_model(LlamaConfig(**COMMON, tie_word_embeddings=False), seed=4)
    path = tmp_path / "q8.gguf"
    write_gguf(hf_model, "llama", path)
    # Rewrite with the down projection of layer 0 quantised to Q8_0.
    reader = gguf.GGUFReader(str(path))
    q8_path = tmp_path / "q8b.gguf"
    writer = gguf.GGUFWriter(str(q8_path), "llama")
    for field in reader.fields.values():
        if field.name.startswith(("llama.", "tokenizer.")):
            writer.add_key_value(field.name, field.contents(), field.types[0])
    original = None
    for t in reader.tensors:
        data = np.array(t.data).reshape(tuple(int(d) for d in reversed(t.shape)))
        if t.name == "blk.0.ffn_down.weight":
            original = data.copy()
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(t.name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    loaded = load_model(ModelConfig(model=str(q8_path), dtype="float32"))
    got = loaded.model.layers[0].mlp.down_proj.weight.numpy()
    assert original is not None and got.shape == original.shape
    err = np.abs(got - original).max()
    assert 0 < err < 0.01 * np.abs(original).max(), err
