"""Unsupported inputs fail early with messages that name the problem."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from tests.model.test_llama_hf import COMMON, _random_hf_model
from tokenloom.config import ModelConfig
from tokenloom.default_model import DEFAULT_GGUF_NAME, default_model_path
from tokenloom.model.arch_reader import load_arch_config
from tokenloom.model.attention import AttentionMetadata
from tokenloom.model.paths import resolve_model_path
from tokenloom.model_loader.loader import load_model


def _tiny_dir(tmp_path: Path) -> Path:
    _random_hf_model(LlamaConfig(**COMMON), seed=0).save_pretrained(tmp_path)
    return tmp_path


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_none_is_the_bundled_default() -> None:
    path = resolve_model_path(None)
    assert path == default_model_path()
    assert path.name == DEFAULT_GGUF_NAME == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        resolve_model_path(str(missing))
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(ModelConfig(model=str(missing)))


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match=r"weights\.bin.*\.gguf"):
        resolve_model_path(str(bad))


def test_directory_without_config_or_weights(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="safetensors"):
        resolve_model_path(str(tmp_path))


def test_unknown_architecture(tmp_path: Path) -> None:
    path = _tiny_dir(tmp_path)
    _edit_config(path, architectures=["GPT2LMHeadModel"])
    for call in (lambda: load_arch_config(path), lambda: load_model(ModelConfig(model=str(path)))):
        with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
            call()
        assert "LlamaForCausalLM" in str(info.value) and "Qwen2ForCausalLM" in str(info.value)


def test_unsupported_rope_scaling_and_activation(tmp_path: Path) -> None:
    path = _tiny_dir(tmp_path)
    # A type no family uses here (mrope is served: Qwen2.5-VL's frequencies are plain RoPE's).
    _edit_config(
        path, rope_parameters={"rope_type": "ntk-by-parts", "factor": 4.0, "rope_theta": 1e4}
    )
    with pytest.raises(ValueError, match="ntk-by-parts"):
        load_arch_config(path)
    _edit_config(path, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    _edit_config(path, hidden_act="gelu")
    with pytest.raises(ValueError, match="gelu"):
        load_arch_config(path)


def test_legacy_rope_keys(tmp_path: Path) -> None:
    path = _tiny_dir(tmp_path)
    config = json.loads((path / "config.json").read_text())
    del config["rope_parameters"]
    config |= {"rope_theta": 1234.0, "rope_scaling": {"type": "linear", "factor": 3.0}}
    (path / "config.json").write_text(json.dumps(config))
    arch = load_arch_config(path)
    assert arch.rope_theta == 1234.0
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 3.0}


def test_missing_weight(tmp_path: Path) -> None:
    path = _tiny_dir(tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.gate_up_proj"):
        load_model(ModelConfig(model=str(path), dtype="float32"))


def test_wrong_shape(tmp_path: Path) -> None:
    path = _tiny_dir(tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        load_model(ModelConfig(model=str(path), dtype="float32"))


def test_unknown_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="gpt2") as info:
        load_arch_config(path)
    assert "llama" in str(info.value)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF"):
        load_arch_config(path)


def test_attention_metadata_rejects_inconsistent_batches() -> None:
    table = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="slot_mapping"):
        AttentionMetadata.build([2, 1], [2, 1], table, torch.zeros(2, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="query_len"):
        AttentionMetadata.build([3, 1], [2, 1], table, torch.zeros(4, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="blocks"):
        AttentionMetadata.build([1, 1], [12, 1], table, torch.zeros(2, dtype=torch.long), 4)
