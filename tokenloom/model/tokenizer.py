"""Loading the tokenizer that belongs to a checkpoint, offline.

``load_tokenizer(path) -> PreTrainedTokenizerBase`` takes a HF model directory
(its tokenizer files) or a ``.gguf`` file, whose tokenizer transformers rebuilds
from the GGUF metadata. For GGUF the chat template and EOS token are set from
``tokenizer.chat_template`` / ``tokenizer.ggml.eos_token_id`` explicitly, so a
transformers version that skips them cannot leave the engine without them.

Rebuilding a GGUF tokenizer takes seconds, so the result is saved once under
``$TOKENLOOM_CACHE_DIR`` (default ``~/.cache/tokenloom``), keyed by the file's
path, size, mtime and the transformers version; ``TOKENLOOM_CACHE_DIR=""``
turns the cache off. The Hub is never contacted.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tokenloom.model.gguf_reader import open_gguf


def _cache_dir(gguf_path: Path) -> Path | None:
    root = os.environ.get("TOKENLOOM_CACHE_DIR", str(Path.home() / ".cache" / "tokenloom"))
    if not root:
        return None
    stat = gguf_path.stat()
    key = f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return Path(root) / "tokenizers" / digest


def _save_to_cache(tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Best effort and atomic: a half-written cache entry is never visible."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent))
        tokenizer.save_pretrained(str(staging))
        try:
            staging.rename(target)
        except OSError:  # another process got there first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError:
        pass


def _load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    cache = _cache_dir(path)
    if cache is not None and (cache / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cache), local_files_only=True)
        except (OSError, ValueError):
            shutil.rmtree(cache, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
    meta = open_gguf(path).metadata
    template = meta.get("tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    if eos_id is not None and tokenizer.eos_token_id != int(eos_id):
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(eos_id))
    if cache is not None:
        _save_to_cache(tokenizer, cache)
    return tokenizer


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(path)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if path.suffix != ".gguf" or not path.is_file():
        raise FileNotFoundError(
            f"no tokenizer at {path}: expected a model directory or a .gguf file"
        )
    return _load_gguf_tokenizer(path.resolve())
