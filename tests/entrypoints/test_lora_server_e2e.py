"""``tokenloom serve --enable-lora --lora-modules ...`` on the default model, driven
with the official ``openai`` client: adapters listed and selected by ``model``,
loaded and unloaded over HTTP while other requests run."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import save_file

from tokenloom.model.arch_reader import load_arch_config
from tokenloom.model.paths import resolve_model_path
from tokenloom.model.peft_config import expected_shapes

from .server_utils import RemoteServer

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
TARGETS = {"self_attn": ("q_proj", "v_proj", "o_proj"), "mlp": ("down_proj",)}


def _write_adapter(path: Path, seed: int) -> None:
    """A random PEFT LoRA adapter (rank 4) for the default model, strong enough to
    change its greedy output."""
    arch = load_arch_config(resolve_model_path(None))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for block, names in TARGETS.items():
            for name in names:
                shapes = expected_shapes(arch, name, 4)
                assert shapes is not None
                prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(*shapes[0], generator=g) * 0.1
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(*shapes[1], generator=g) * 0.1
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": [n for v in TARGETS.values() for n in v],
    }
    (path / "adapter_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("adapters")
    for i in range(2):
        _write_adapter(root / f"ad{i}", seed=i)
    return [root / "ad0", root / "ad1"]


@pytest.fixture(scope="module")
def server(
    adapter_dirs: list[Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    # float32: bf16 (auto on CPUs with native bf16) makes greedy text depend on the batch shape,
    # and the long request below shares its steps with others.
    args = ["--dtype", "float32", "--max-model-len", "512", "--num-blocks", "256"]
    args += ["--max-num-seqs", "8"]
    args += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    args += ["--lora-modules", f"first={adapter_dirs[0]}"]
    server = RemoteServer(args, log)
    yield server
    server.stop()


def _greedy(client: openai.OpenAI, model: str, max_tokens: int = 8) -> str:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0
    )
    return out.choices[0].text


def test_openai_client_selects_adapters(server: RemoteServer, adapter_dirs: list[Path]) -> None:
    with server.openai_client(timeout=120) as client:
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {MODEL, "first"}
        base = _greedy(client, MODEL)
        first = _greedy(client, "first")
        assert first != base and _greedy(client, "first") == first

        # A long request with the adapter runs while adapters are loaded and unloaded.
        result: dict[str, str] = {}

        def long_request() -> None:
            result["text"] = _greedy(client, "first", max_tokens=120)

        thread = threading.Thread(target=long_request)
        thread.start()
        url = server.url
        loaded = httpx.post(
            url + "/v1/load_lora_adapter",
            json={"lora_name": "second", "lora_path": str(adapter_dirs[1])},
            timeout=60,
        )
        assert loaded.status_code == 200, loaded.text
        second = _greedy(client, "second")
        assert second not in (base, first)
        busy = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "first"}, timeout=60)
        still_running = thread.is_alive()
        thread.join()
        if still_running:
            assert busy.status_code == 400 and "in use" in busy.text
        assert result["text"].startswith(first)
        gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "first"}, timeout=60)
        assert gone.status_code == 200
        assert {m.id for m in client.models.list().data} == {MODEL, "second"}
        with pytest.raises(openai.BadRequestError):
            _greedy(client, "first")
        assert _greedy(client, MODEL) == base
        bad = httpx.post(
            url + "/v1/load_lora_adapter",
            json={"lora_name": "bad", "lora_path": str(adapter_dirs[0].parent / "missing")},
            timeout=60,
        )
        assert bad.status_code == 400 and "missing" in bad.json()["error"]["message"]
