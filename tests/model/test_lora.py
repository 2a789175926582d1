"""LoRA on a tiny random Llama: one ragged batch mixing three PEFT adapters (built
with peft, different ranks and targets, one rsLoRA) and the base model matches, row
for row, transformers with each adapter merged; slots are reused; bad adapters
are refused with clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.model.harness import BlockAllocator, Seq, run_step
from tokenloom.config import LoRAConfig, ModelConfig
from tokenloom.lora_request import LoRARequest
from tokenloom.model.kv_cache import allocate_kv_caches
from tokenloom.model.llama import CausalLM
from tokenloom.model.lora import LoRAManager
from tokenloom.model.peft_config import read_peft_config, validate_adapter
from tokenloom.model_loader.loader import load_model

VOCAB = 128
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name: (rank, targets, rslora)
    "a": (8, ALL, False),
    "b": (4, ["q_proj", "v_proj"], False),
    "c": (2, ["k_proj", "o_proj", "down_proj", "up_proj"], True),
}


def _base_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.uniform_(0.7, 1.3) if "norm" in name else param.normal_(0.0, 0.1)
    return model.eval()


def make_adapter(
    base: torch.nn.Module, path: Path, rank: int, targets: list, rslora: bool, seed: int
) -> None:
    """A random PEFT adapter for ``base`` saved at ``path`` (B nonzero, unlike
    peft's default init)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=targets,
        use_rslora=rslora,
        init_lora_weights=False,
    )
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    model.unload()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lora")
    base = _base_model()
    base.save_pretrained(root / "base")
    references = {}
    for i, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items()):
        make_adapter(_base_model(), root / name, rank, targets, rslora, seed=10 + i)
        merged = peft.PeftModel.from_pretrained(_base_model(), root / name).merge_and_unload()
        references[name] = merged.eval()
    references["base"] = base
    return root, references


def _ours(root: Path, max_loras: int) -> tuple[CausalLM, LoRAManager]:
    loaded = load_model(ModelConfig(model=str(root / "base"), dtype="float32"), float_weights=True)
    model = loaded.model
    assert isinstance(model, CausalLM)
    manager = LoRAManager(model, LoRAConfig(max_loras=max_loras, max_lora_rank=8))
    for i, name in enumerate(ADAPTERS, start=1):
        manager.add_adapter(LoRARequest(name, i, str(root / name)))
    return model, manager


def _run(model, manager, seqs, adapter_ids, steps) -> dict[str, list[tuple[int, torch.Tensor]]]:
    kv = allocate_kv_caches(model.arch, 64, 4, torch.float32, "cpu")
    alloc = BlockAllocator(4)
    out: dict[str, list[tuple[int, torch.Tensor]]] = {name: [] for name in seqs}
    for schedule in steps:
        token_ids = np.concatenate([[adapter_ids[name]] * n for name, n in schedule])
        manager.prepare(token_ids)
        starts = [seqs[name].num_computed for name, _ in schedule]
        rows = run_step(model, kv, alloc, [(seqs[name], n) for name, n in schedule])
        for (name, _), start, logits in zip(schedule, starts, rows, strict=True):
            out[name].append((start, logits))
    return out


def _reference(references, seqs) -> dict[str, torch.Tensor]:
    with torch.inference_mode():
        return {
            name: references[name](torch.tensor([seq.tokens])).logits[0]
            for name, seq in seqs.items()
        }


def test_mixed_batch_matches_merged_adapters(setup) -> None:
    root, references = setup
    model, manager = _ours(root, max_loras=3)
    g = torch.Generator().manual_seed(0)
    seqs = {name: Seq(torch.randint(0, VOCAB, (12,), generator=g).tolist()) for name in references}
    ids = {"a": 1, "b": 2, "c": 3, "base": 0}
    # prefill chunks and decodes of all four in the same steps
    steps = [
        [("a", 7), ("base", 5), ("b", 9), ("c", 3)],
        [("a", 1), ("c", 6), ("base", 4), ("b", 1)],
        [("b", 1), ("a", 1), ("base", 1), ("c", 1)],
        [("c", 2), ("base", 2), ("a", 3), ("b", 1)],
    ]
    ours = _run(model, manager, seqs, ids, steps)
    reference = _reference(references, seqs)
    for name, chunks in ours.items():
        for start, logits in chunks:
            ref = reference[name][start : start + logits.shape[0]]
            diff = (logits - ref).abs().max().item()
            assert diff < 1e-4, f"{name}: max |logit diff| {diff:.2e}"
            assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    # the adapters do change the output
    base_logits = reference["base"]
    for name in ADAPTERS:
        other = references[name](torch.tensor([seqs["base"].tokens])).logits[0]
        assert (other - base_logits).abs().max().item() > 1e-2


def test_slots_are_reused_across_steps(setup) -> None:
    """With one slot, steps alternate adapters; each step's rows stay exact."""
    root, references = setup
    model, manager = _ours(root, max_loras=1)
    g = torch.Generator().manual_seed(1)
    seqs = {name: Seq(torch.randint(0, VOCAB, (6,), generator=g).tolist()) for name in references}
    ids = {"a": 1, "b": 2, "c": 3, "base": 0}
    steps = [[("a", 5), ("base", 5)], [("b", 5)], [("a", 1), ("base", 1)], [("c", 6)], [("b", 1)]]
    ours = _run(model, manager, seqs, ids, steps)
    reference = _reference(references, seqs)
    for name, chunks in ours.items():
        for start, logits in chunks:
            ref = reference[name][start : start + logits.shape[0]]
            assert (logits - ref).abs().max().item() < 1e-4, name
    with pytest.raises(ValueError, match="max_loras=1"):
        manager.prepare(np.array([1, 2]))
    assert manager.remove_adapter(2) and not manager.remove_adapter(2)
    with pytest.raises(KeyError, match="not registered"):
        manager.prepare(np.array([2, 2]))


def test_bad_adapters_are_refused(setup, tmp_path: Path) -> None:
    root, _ = setup
    with pytest.raises(ValueError, match="is not a directory"):
        read_peft_config(tmp_path / "missing", 16)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        read_peft_config(tmp_path, 16)
    with pytest.raises(ValueError, match="rank 8, above max_lora_rank=4"):
        read_peft_config(root / "a", 4)
    bad = tmp_path / "dora"
    bad.mkdir()
    (bad / "adapter_model.safetensors").write_bytes(
        (root / "a" / "adapter_model.safetensors").read_bytes()
    )
    cfg = json.loads((root / "a" / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        read_peft_config(bad, 16)
    # an adapter for a model of other shapes
    other = _base_model()
    wide = AutoModelForCausalLM.from_config(
        LlamaConfig(**{**CONFIG, "intermediate_size": 80}), dtype=torch.float32
    )
    del other
    make_adapter(wide, tmp_path / "wide", 4, ["gate_proj"], False, seed=3)
    model, manager = _ours(root, max_loras=1)
    with pytest.raises(ValueError, match="another model"):
        manager.add_adapter(LoRARequest("wide", 9, str(tmp_path / "wide")))
    # the torch-free check the server runs says the same before the engine sees it
    with pytest.raises(ValueError, match="another model"):
        validate_adapter(tmp_path / "wide", 16, model.arch)
    assert validate_adapter(root / "c", 16, model.arch).rank == 2
    # a model loaded for the native kernels, which would multiply past the adapters
    native = load_model(ModelConfig(model=str(root / "base"), dtype="float32"))
    assert native.plan.matmul == "native"
    with pytest.raises(ValueError, match=r"float_weights=True"):
        LoRAManager(native.model, LoRAConfig(max_loras=1, max_lora_rank=8))
