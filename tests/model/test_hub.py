"""Hugging Face ids resolve from a local Hugging Face cache (built here, no
network): HF_HOME, HF_HUB_OFFLINE and revisions are honoured, and an id that is
neither cached nor reachable is an error naming the cache directory."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tokenloom.config import ModelConfig
from tokenloom.model.hub import hub_cache_dir, looks_like_hub_id, resolve_hub_model
from tokenloom.model_loader.loader import load_model, resolve_model_path

MAIN = "a" * 40
V2 = "b" * 40


def _snapshot(cache: Path, repo: str, commit: str, source: Path, refs: list[str]) -> Path:
    """Lay out ``source`` as the snapshot ``commit`` of ``repo`` the way
    huggingface_hub stores it (blobs linked from snapshots/, refs/ naming commits)."""
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo_dir / "blobs").mkdir(exist_ok=True)
    for file in source.iterdir():
        blob = repo_dir / "blobs" / f"{commit[:8]}-{file.name}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(blob)
    (repo_dir / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo_dir / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hf_home" / "hub"
    for commit, layers, refs in ((MAIN, 1, ["main"]), (V2, 2, ["v2"])):
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=layers,
            num_attention_heads=2,
            max_position_embeddings=64,
        )
        source = tmp_path / f"src{layers}"
        AutoModelForCausalLM.from_config(config).save_pretrained(source)
        _snapshot(cache, "org/tiny", commit, source, refs)
    return cache


def test_cache_dir_follows_environment(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert hub_cache_dir() == hub
    monkeypatch.setenv("HF_HUB_CACHE", "/elsewhere/hub")
    assert hub_cache_dir() == Path("/elsewhere/hub")


def test_resolves_ids_and_revisions_from_cache(hub: Path) -> None:
    assert looks_like_hub_id("org/tiny") and not looks_like_hub_id("./org/tiny")
    assert resolve_hub_model("org/tiny") == hub / "models--org--tiny" / "snapshots" / MAIN
    assert resolve_hub_model("org/tiny", "v2").name == V2
    assert resolve_hub_model("org/tiny", MAIN).name == MAIN
    assert resolve_model_path("org/tiny", "v2").name == V2
    loaded = load_model(ModelConfig(model="org/tiny", revision="v2", dtype="float32"))
    assert loaded.arch.num_hidden_layers == 2 and loaded.path.name == V2
    assert load_model(ModelConfig(model="org/tiny")).arch.num_hidden_layers == 1


def test_missing_id_names_the_cache(hub: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_path("org/absent")
    message = str(info.value)
    assert str(hub) in message and "'org/absent'" in message and "HF_HUB_OFFLINE" in message
    with pytest.raises(FileNotFoundError, match="revision 'nope'"):
        resolve_hub_model("org/tiny", "nope")


def test_unreachable_hub_falls_back_to_cache(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Online mode with the Hub unreachable (a closed local port): a cached id
    still resolves, an uncached one fails saying the download failed."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")
    assert resolve_hub_model("org/tiny").name == MAIN
    with pytest.raises(FileNotFoundError, match="downloading it failed") as info:
        resolve_hub_model("org/absent")
    assert str(hub) in str(info.value)


def test_served_name_of_an_id_is_the_id(hub: Path) -> None:
    from tokenloom.entrypoints.openai.server import default_served_model_name

    assert default_served_model_name("org/tiny") == "org/tiny"
    assert default_served_model_name(str(hub)) == "hub"
