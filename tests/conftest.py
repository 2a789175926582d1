"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tokenloom.default_model import default_model_path as default_gguf_path

# Without a GPU the CUDA backend's Triton kernels run in Triton's interpreter, on
# the CPU; it must be chosen before any kernel is defined.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    path = default_gguf_path()
    assert path.exists(), f"default model missing: {path}"
    return path


def _write_default_hf_model(out: Path) -> None:
    """Convert the default GGUF with transformers' own loader and save it as HF files."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = default_gguf_path()
    source = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    with torch.device("meta"):
        plain = LlamaForCausalLM(source.config)
    plain.load_state_dict(source.state_dict(), assign=True)
    plain.tie_weights()
    # The weights are plain fp32 now: drop the GGUF quantisation marker.
    if hasattr(plain.config, "quantization_config"):
        del plain.config.quantization_config
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)


@pytest.fixture(scope="session")
def default_hf_model_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The default model as a Hugging Face directory (config.json, fp32 safetensors,
    tokenizer files), converted by transformers' own GGUF loader.

    It is the independent reference for tokenloom's GGUF path, and a way to run
    tokenloom's HF-directory path on the real model. transformers refuses
    save_pretrained on a GGUF-loaded model, so the weights move into a plain
    LlamaForCausalLM first. The conversion takes a minute on two cores, so the
    result is kept in pytest's cache directory, keyed by the GGUF file and the
    transformers version, and published atomically (parallel sessions are safe).
    """
    import hashlib
    import os
    import shutil
    import tempfile

    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cache = getattr(request.config, "cache", None)
    if cache is None:  # -p no:cacheprovider
        out = tmp_path_factory.mktemp("default_hf_model")
        _write_default_hf_model(out)
        return out
    gguf = default_gguf_path()
    stat = gguf.stat()
    key = f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    root = Path(cache.mkdir("tokenloom_default_hf_model"))
    out = root / hashlib.sha256(key.encode()).hexdigest()[:16]
    if (out / "config.json").is_file():
        return out
    staging = Path(tempfile.mkdtemp(dir=root))
    _write_default_hf_model(staging)
    try:
        staging.rename(out)
    except OSError:  # another session published it first
        shutil.rmtree(staging, ignore_errors=True)
    return out


@pytest.fixture(scope="session")
def scripted_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 reasoning model whose greedy output is scripted
    (``tests/entrypoints/scripted_model.py``); written in a second or two."""
    from tests.entrypoints.scripted_model import write_scripted_model

    return write_scripted_model(tmp_path_factory.mktemp("scripted_model"))
