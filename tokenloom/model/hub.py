"""Hugging Face ids (``org/name``) as model sources, resolved with huggingface_hub.

``resolve_hub_model(repo_id, revision)`` returns the local snapshot directory of
the id: from the Hugging Face cache when it is there, else downloaded into it
(only the files a model needs: configs, safetensors, tokenizer). The cache is
the one huggingface_hub uses (``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``), read when called, not when imported;
``HF_HUB_OFFLINE=1`` forbids the network. When the id is neither cached nor
reachable the error says so and names the cache directory. Torch-free.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_MODEL_FILES = [
    "*.json",
    "*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
]


def looks_like_hub_id(model: str) -> bool:
    """``org/name`` that is not a path on this machine."""
    return bool(_HUB_ID.match(model)) and not Path(model).expanduser().exists()


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def resolve_hub_model(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot directory of ``repo_id`` at ``revision`` (None: the default branch)."""
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    offline = hub_offline()
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(cache),
            allow_patterns=_MODEL_FILES,
            local_files_only=offline,
        )
    except Exception as e:  # noqa: BLE001 - not found, offline, no network, bad revision
        where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
        how = (
            "HF_HUB_OFFLINE is set, so nothing is downloaded"
            if offline
            else f"downloading it failed ({type(e).__name__}: {e})"
        )
        raise FileNotFoundError(
            f"model {where} is not in the Hugging Face cache at {cache} and {how}; "
            "download it there (huggingface-cli download), set HF_HOME or HF_HUB_CACHE to "
            "the cache that has it, or pass a local directory"
        ) from None
    return Path(path)
