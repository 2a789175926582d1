"""Loading the tokenizer that belongs to a checkpoint, offline and without torch.

``load_tokenizer(path) -> PreTrainedTokenizerFast`` takes a HF model directory
or a ``.gguf`` file. The HTTP front end must not import torch, and
transformers' loaders that *convert* a tokenizer (from GGUF metadata, or from
a slow SentencePiece model) do. So:

- a directory with ``tokenizer.json`` is loaded as is with ``PreTrainedTokenizerFast``;
- anything else is converted once, by a subprocess running this module
  (``AutoTokenizer``), into a fast-tokenizer directory under
  ``$TOKENLOOM_CACHE_DIR/tokenizers/<key>`` (default ``~/.cache/tokenloom``),
  which is then loaded like the first case. The key holds the source's path,
  size, mtime and the transformers version. ``TOKENLOOM_CACHE_DIR=""`` turns
  the cache off: the conversion then goes to a temporary directory.

For GGUF the chat template and EOS token are set from
``tokenizer.chat_template`` / ``tokenizer.ggml.eos_token_id`` explicitly, so a
transformers version that skips them cannot leave the engine without them.
The Hub is never contacted.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import transformers
from transformers import PreTrainedTokenizerFast

# Files of a model directory that define its tokenizer (their stats key the cache).
_TOKENIZER_FILES = (
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)
_CONVERT_TIMEOUT_S = 600


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer of a HF model directory or a ``.gguf`` file; never imports torch."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return _load_fast(path)
        return _load_converted(path.resolve())
    if path.suffix != ".gguf" or not path.is_file():
        raise FileNotFoundError(
            f"no tokenizer at {path}: expected a model directory or a .gguf file"
        )
    return _load_converted(path.resolve())


def _load_fast(directory: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)


def _cache_dir(source: Path) -> Path | None:
    root = os.environ.get("TOKENLOOM_CACHE_DIR", str(Path.home() / ".cache" / "tokenloom"))
    if not root:
        return None
    files = [source] if source.is_file() else [source / n for n in _TOKENIZER_FILES]
    stats = [f"{f}|{st.st_size}|{st.st_mtime_ns}" for f in files if (st := _stat(f)) is not None]
    key = "|".join([*stats, transformers.__version__])
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return Path(root) / "tokenizers" / digest


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


def _load_converted(source: Path) -> PreTrainedTokenizerFast:
    cache = _cache_dir(source)
    if cache is None:
        with tempfile.TemporaryDirectory(prefix="tokenloom-tokenizer-") as tmp:
            _convert_in_subprocess(source, Path(tmp))
            return _load_fast(Path(tmp))
    if (cache / "tokenizer.json").is_file():
        try:
            return _load_fast(cache)
        except (OSError, ValueError):
            shutil.rmtree(cache, ignore_errors=True)  # a stale or damaged entry: rebuild it
    cache.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache.parent))
    try:
        _convert_in_subprocess(source, staging)
        staging.rename(cache)  # atomic: a half-written entry is never visible
    except OSError:
        if not (cache / "tokenizer.json").is_file():  # not just another process first
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return _load_fast(cache)


def _convert_in_subprocess(source: Path, target: Path) -> None:
    """Run ``_convert`` in a fresh interpreter, so its torch import stays out of this process."""
    package_root = str(Path(__file__).resolve().parents[2])
    pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": pythonpath}
    command = [sys.executable, "-m", "tokenloom.model.tokenizer", str(source), str(target)]
    result = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=_CONVERT_TIMEOUT_S
    )
    if result.returncode != 0 or not (target / "tokenizer.json").is_file():
        lines = (result.stderr or "no output").strip().splitlines()
        raise ValueError(f"cannot build the tokenizer of {source}: {lines[-1] if lines else ''}")


def _convert(source: Path, target: Path) -> None:
    """Build the tokenizer with transformers' own loaders and save it as a fast-tokenizer dir."""
    from transformers import AutoTokenizer  # imports torch: only ever run in a subprocess

    if source.is_dir():
        tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    else:
        tokenizer = AutoTokenizer.from_pretrained(
            str(source.parent), gguf_file=source.name, local_files_only=True
        )
        from tokenloom.model.gguf_reader import open_gguf

        meta = open_gguf(source).metadata
        template = meta.get("tokenizer.chat_template")
        if template and not tokenizer.chat_template:
            tokenizer.chat_template = template
        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        if eos_id is not None and tokenizer.eos_token_id != int(eos_id):
            tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(eos_id))
    if not tokenizer.is_fast:
        raise SystemExit(f"{source} has no fast (Rust) tokenizer")
    tokenizer.save_pretrained(str(target))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m tokenloom.model.tokenizer SOURCE TARGET_DIR")
    _convert(Path(sys.argv[1]), Path(sys.argv[2]))
