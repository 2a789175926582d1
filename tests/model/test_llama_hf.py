"""Tiny random models of each supported architecture, saved as HF directories,
must give transformers' logits through our paged, ragged-batch forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
)

from tests.model.scenario import BLOCK_SIZE, make_sequences, max_abs_diff, run_scenario
from tokenloom.config import ModelConfig
from tokenloom.model.dtype import resolve_dtype, resolve_kv_cache_dtype
from tokenloom.model.kv_cache import allocate_kv_caches
from tokenloom.model_loader.loader import load_model

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)


def _cases() -> dict[str, PretrainedConfig]:
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return {
        "llama_untied": LlamaConfig(**COMMON, tie_word_embeddings=False, rope_theta=500.0),
        "llama_tied_llama3": LlamaConfig(**COMMON, tie_word_embeddings=True, rope_scaling=llama3),
        "llama_mha_linear": LlamaConfig(
            **{**COMMON, "num_key_value_heads": 4},
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
        "mistral_head_dim": MistralConfig(**COMMON, head_dim=32, sliding_window=None),
        "qwen2_bias_tied": Qwen2Config(**COMMON, tie_word_embeddings=True),
        "qwen2_bias_untied": Qwen2Config(**COMMON, tie_word_embeddings=False),
    }


def _random_hf_model(config: PretrainedConfig, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.7, 1.3)
            else:
                param.normal_(0.0, 0.1)  # biases too: Qwen2 initialises them to zero
    return model.eval()


def _reference_logits(hf_model: torch.nn.Module, seqs: dict) -> dict[str, torch.Tensor]:
    with torch.inference_mode():
        return {
            name: hf_model(torch.tensor([seq.tokens])).logits[0].float()
            for name, seq in seqs.items()
        }


def _run_ours(path: Path) -> tuple[dict, dict]:
    loaded = load_model(ModelConfig(model=str(path), dtype="float32"))
    kv = allocate_kv_caches(loaded.arch, 32, BLOCK_SIZE, loaded.dtype, "cpu")
    seqs = make_sequences(VOCAB, seed=1)
    return seqs, run_scenario(loaded.model, kv, seqs)


@pytest.mark.parametrize("case", list(_cases()))
def test_matches_transformers(case: str, tmp_path: Path) -> None:
    hf_model = _random_hf_model(_cases()[case], seed=hash(case) % 1000)
    hf_model.save_pretrained(tmp_path)
    seqs, ours = _run_ours(tmp_path)
    diff = max_abs_diff(ours, _reference_logits(hf_model, seqs))
    assert diff < 1e-4, f"{case}: max |logit diff| {diff:.2e}"


def test_bf16_sharded_checkpoint(tmp_path: Path) -> None:
    """bf16 source weights split over several safetensors files (with an index)."""
    hf_model = _random_hf_model(LlamaConfig(**COMMON, tie_word_embeddings=False), seed=7)
    hf_model.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert (tmp_path / "model.safetensors.index.json").is_file()
    # Reload in fp32 (bf16 values are exact there); casting the in-memory model
    # back would also have rounded its RoPE buffer.
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    seqs, ours = _run_ours(tmp_path)
    diff = max_abs_diff(ours, _reference_logits(hf_model, seqs))
    assert diff < 1e-4, f"max |logit diff| {diff:.2e}"


def test_wrong_logits_are_detected(tmp_path: Path) -> None:
    """The comparison can fail: a model with one weight changed is far off."""
    hf_model = _random_hf_model(LlamaConfig(**COMMON), seed=3)
    hf_model.save_pretrained(tmp_path)
    with torch.no_grad():
        hf_model.model.layers[0].self_attn.k_proj.weight[0, 0] += 1.0
    seqs, ours = _run_ours(tmp_path)
    assert max_abs_diff(ours, _reference_logits(hf_model, seqs)) > 1e-3


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_stays_close(dtype: str, tmp_path: Path) -> None:
    """16-bit weights stay 16-bit (float16 becomes bfloat16 on a CPU without float16
    arithmetic), K/V in their dtype as serving allocates them, and the logits land
    near fp32."""
    hf_model = _random_hf_model(_cases()["qwen2_bias_untied"], seed=5)
    hf_model.save_pretrained(tmp_path)
    loaded = load_model(ModelConfig(model=str(tmp_path), dtype=dtype))
    kept = resolve_dtype(dtype, "cpu").dtype
    assert kept in (torch.bfloat16, torch.float16) and loaded.weights_dtype == kept
    assert loaded.model.embed_tokens.weight.dtype == kept
    assert loaded.model.layers[0].mlp.down_proj.weight.dtype == kept
    kv_dtype = resolve_kv_cache_dtype("auto", loaded.weights_dtype, loaded.quantized)
    kv = allocate_kv_caches(loaded.arch, 32, BLOCK_SIZE, kv_dtype, "cpu")
    assert kv[0][0].dtype == kept
    seqs = make_sequences(VOCAB, seed=1)
    ours = run_scenario(loaded.model, kv, seqs)
    assert all(logits.dtype == torch.float32 for chunks in ours.values() for _, logits in chunks)
    reference = _reference_logits(hf_model, seqs)
    scale = max(ref.abs().max().item() for ref in reference.values())
    diff = max_abs_diff(ours, reference)
    assert diff < 0.05 * scale, f"{dtype}: max |logit diff| {diff:.3f} (logit scale {scale:.2f})"
