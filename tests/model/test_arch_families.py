"""config.json handling of the families (no weights): per-layer windows, Gemma's
settings, Phi-3's long-rope checks, YaRN/dynamic context lengths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenloom.model.arch_reader import load_arch_config

BASE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
}


def _arch(tmp_path: Path, **cfg):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **cfg}))
    return load_arch_config(tmp_path)


def test_default_window_patterns(tmp_path: Path) -> None:
    g2 = _arch(tmp_path, architectures=["Gemma2ForCausalLM"], sliding_window=16)
    assert g2.layer_windows == (16, None) * 3
    assert g2.tie_word_embeddings and g2.qk_norm is False
    g3 = _arch(
        tmp_path,
        architectures=["Gemma3ForCausalLM"],
        sliding_window=16,
        head_dim=16,
        query_pre_attn_scalar=64,
        rope_local_base_freq=10.0,
        rope_theta=1e6,
    )
    assert g3.layer_windows == (16,) * 5 + (None,)
    assert g3.qk_norm and g3.local_rope_theta == 10.0 and g3.rope_theta == 1e6
    assert g3.attention_scale == pytest.approx(64**-0.5)
    qwen = _arch(
        tmp_path,
        architectures=["Qwen2ForCausalLM"],
        sliding_window=16,
        use_sliding_window=True,
        max_window_layers=4,
    )
    assert qwen.layer_windows == (None,) * 4 + (16, 16)
    assert (
        _arch(tmp_path, architectures=["Qwen3ForCausalLM"], sliding_window=16).layer_windows == ()
    )
    mistral = _arch(tmp_path, architectures=["MistralForCausalLM"], sliding_window=16)
    assert mistral.layer_windows == (16,) * 6 and mistral.max_position_embeddings == 256
    explicit = ["full_attention", "sliding_attention"] * 3
    assert (
        _arch(
            tmp_path, architectures=["Gemma2ForCausalLM"], sliding_window=8, layer_types=explicit
        ).layer_windows
        == (None, 8) * 3
    )
    with pytest.raises(ValueError, match="layer_types .* 2 entries for 6 layers"):
        _arch(
            tmp_path,
            architectures=["MistralForCausalLM"],
            sliding_window=8,
            layer_types=explicit[:2],
        )


def test_rope_scaling_lengths_and_checks(tmp_path: Path) -> None:
    yarn = _arch(
        tmp_path,
        architectures=["Qwen3ForCausalLM"],
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    )
    assert yarn.max_position_embeddings == 512
    dynamic = _arch(
        tmp_path,
        architectures=["LlamaForCausalLM"],
        rope_scaling={"type": "dynamic", "factor": 2.0},
    )
    assert dynamic.max_position_embeddings == 512
    assert dynamic.rope_scaling == {
        "rope_type": "dynamic",
        "factor": 2.0,
        "original_max_position_embeddings": 256,
    }
    phi = _arch(
        tmp_path,
        architectures=["Phi3ForCausalLM"],
        original_max_position_embeddings=64,
        partial_rotary_factor=0.5,
        rope_scaling={"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
    )
    assert phi.partial_rotary_factor == 0.5 and phi.rope_scaling is not None
    assert phi.rope_scaling["rope_type"] == "longrope"
    assert phi.rope_scaling["original_max_position_embeddings"] == 64
    with pytest.raises(ValueError, match="long_factor .* must have 4 entries"):
        _arch(
            tmp_path,
            architectures=["Phi3ForCausalLM"],
            partial_rotary_factor=0.5,
            rope_scaling={"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0]},
        )
    with pytest.raises(ValueError, match="hidden_act 'relu'"):
        _arch(tmp_path, architectures=["LlamaForCausalLM"], hidden_act="relu")
