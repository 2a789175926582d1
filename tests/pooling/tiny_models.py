"""Tiny random-weight decoders for the pooling tests, with the default model's
tokenizer, and transformers' pooled final hidden states of them as the reference."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen3Config

from tokenloom.default_model import default_model_path
from tokenloom.model.tokenizer import load_tokenizer

VOCAB = 49152  # the default model's tokenizer
HIDDEN = 64
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=True,
)
CONFIGS: dict[str, PretrainedConfig] = {
    # Marked Matryoshka, so requests may shorten its embeddings.
    "qwen3": Qwen3Config(**_COMMON, is_matryoshka=True),
    "llama": LlamaConfig(**_COMMON),
}


def write_model(name: str, out: Path) -> Path:
    """Model ``name`` of CONFIGS with random weights (seeded), as a Hugging Face
    directory with the default model's tokenizer."""
    config = CONFIGS[name]
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.uniform_(0.7, 1.3)
            else:
                param.normal_(0.0, 0.1)
    model.save_pretrained(out)
    load_tokenizer(default_model_path()).save_pretrained(out)
    return out


class Reference:
    """transformers' final hidden states (after the final norm) of one model, pooled."""

    def __init__(self, path: Path, dtype: torch.dtype = torch.float32) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()

    def hidden(self, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            out = self.model.model(torch.tensor([ids]))
        return out.last_hidden_state[0].float()

    def embed(self, ids: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
        hidden = self.hidden(ids)
        vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling]
        return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


_ST = "sentence_transformers.models."


def write_sentence_transformers(model_dir: Path, mode: str | None, *, normalize: bool) -> Path:
    """Add a Sentence-Transformers pipeline to ``model_dir``: a Transformer, a Pooling
    module pooling by ``pooling_mode_<mode>`` (none when ``mode`` is None) and, with
    ``normalize``, a Normalize module."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": _ST + "Transformer"}]
    if mode is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": _ST + "Pooling"})
        (model_dir / "1_Pooling").mkdir(exist_ok=True)
        flags = {
            f"pooling_mode_{m}": m == mode
            for m in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")
        }
        (model_dir / "1_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": HIDDEN, **flags, "include_prompt": True})
        )
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": _ST + "Normalize"})
    (model_dir / "modules.json").write_text(json.dumps(modules))
    return model_dir
