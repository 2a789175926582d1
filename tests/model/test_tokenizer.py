"""The default GGUF's tokenizer: built from GGUF metadata (in a subprocess), cached on
disk, identical to the one transformers builds, and loaded without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tokenloom.model.arch_reader import load_arch_config
from tokenloom.model.tokenizer import load_tokenizer

pytestmark = pytest.mark.e2e

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnewlines",
    "Ünïcödé — emoji 🙂 and 数字 12345",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "def f(x):\n    return x ** 2",
]
EXPECTED_CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
)


def test_gguf_tokenizer_matches_transformers(
    default_model_path: Path, default_hf_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    reference = AutoTokenizer.from_pretrained(default_hf_model_dir)
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path))
    built = load_tokenizer(default_model_path)  # converts, then writes the cache
    assert list((tmp_path / "tokenizers").iterdir()), "cache entry not written"
    cached = load_tokenizer(default_model_path)  # read back from the cache
    arch = load_arch_config(default_model_path)

    for tok in (built, cached):
        assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == arch.eos_token_ids[0] == 2
        assert tok.bos_token_id == arch.bos_token_id == 1
        assert len(tok) == arch.vocab_size
        for text in TEXTS:
            ids = tok(text).input_ids
            assert ids == reference(text).input_ids, text
            assert tok.decode(ids) == text
        chat = [{"role": "user", "content": "Hi there"}]
        rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert rendered == EXPECTED_CHAT


def test_hf_directory_tokenizer(default_hf_model_dir: Path) -> None:
    tok = load_tokenizer(default_hf_model_dir)
    assert tok("Hello, world!").input_ids == [19556, 28, 905, 17]
    assert tok.eos_token_id == 2 and tok.chat_template


def test_loading_imports_no_torch(default_model_path: Path, default_hf_model_dir: Path) -> None:
    code = (
        "import sys\n"
        "from tokenloom.model.tokenizer import load_tokenizer\n"
        f"for path in ({str(default_model_path)!r}, {str(default_hf_model_dir)!r}):\n"
        "    tok = load_tokenizer(path)\n"
        "    tok.apply_chat_template([{'role': 'user', 'content': 'x'}], tokenize=False)\n"
        "    tok.decode(tok.encode('Hello'))\n"
        "sys.exit(1 if 'torch' in sys.modules else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:] or "torch was imported"


def test_unreadable_gguf_is_a_value_error_and_leaves_no_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(cache))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ValueError, match="cannot build the tokenizer of .*broken.gguf"):
        load_tokenizer(broken)
    assert not any((cache / "tokenizers").iterdir())


def test_no_tokenizer_for_bad_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="weights.bin"):
        load_tokenizer(tmp_path / "weights.bin")
