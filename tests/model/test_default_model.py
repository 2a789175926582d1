"""The bundled SmolLM2-135M GGUF: our dequantisation, Q/K un-permutation and
forward against transformers' independent GGUF conversion, and our HF-directory
path against our GGUF path. fp32 throughout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model.harness import BlockAllocator, Seq, run_step
from tests.model.scenario import BLOCK_SIZE, make_sequences, max_abs_diff, run_scenario
from tokenloom.config import ModelConfig
from tokenloom.model.kv_cache import allocate_kv_caches
from tokenloom.model.tokenizer import load_tokenizer
from tokenloom.model_loader.loader import LoadedModel, load_model

pytestmark = pytest.mark.e2e

# Logits reach ~±40 over 30 layers of fp32; measured differences are ~5e-5.
ATOL = 1e-3
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colours of the rainbow:",
]


def _kv(loaded: LoadedModel) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return allocate_kv_caches(loaded.arch, 64, BLOCK_SIZE, loaded.dtype, "cpu")


def test_greedy_prompts_match_transformers(
    gguf_model: LoadedModel, hf_reference: torch.nn.Module, default_model_path: Path
) -> None:
    tokenizer = load_tokenizer(default_model_path)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    new_tokens = 5
    full = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf_reference.generate(
                torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False
            )
            full.append(out[0].tolist())
        reference = [hf_reference(torch.tensor([seq])).logits[0] for seq in full]

    seqs = [Seq(tokens) for tokens in full]
    alloc = BlockAllocator(BLOCK_SIZE)
    kv = _kv(gguf_model)
    rows = [
        run_step(
            gguf_model.model, kv, alloc, [(s, len(p)) for s, p in zip(seqs, prompts, strict=True)]
        )
    ]
    for _ in range(new_tokens - 1):
        rows.append(run_step(gguf_model.model, kv, alloc, [(s, 1) for s in seqs]))

    for i, (seq, ids) in enumerate(zip(seqs, prompts, strict=True)):
        ours = torch.cat([step[i] for step in rows])  # positions 0 .. len(tokens) - 2
        ref = reference[i][: ours.shape[0]]
        diff = (ours - ref).abs().max().item()
        assert diff < ATOL, f"prompt {i}: max |logit diff| {diff:.2e}"
        # The greedy continuation transformers produced is our argmax too.
        assert ours[len(ids) - 1 :].argmax(-1).tolist() == seq.tokens[len(ids) :]


def test_ragged_scenario_matches_transformers(
    gguf_model: LoadedModel, hf_reference: torch.nn.Module
) -> None:
    seqs = make_sequences(gguf_model.arch.vocab_size, seed=5)
    ours = run_scenario(gguf_model.model, _kv(gguf_model), seqs)
    with torch.inference_mode():
        ref = {n: hf_reference(torch.tensor([s.tokens])).logits[0] for n, s in seqs.items()}
    diff = max_abs_diff(ours, ref)
    assert diff < ATOL, f"max |logit diff| {diff:.2e}"


def test_hf_directory_matches_gguf(gguf_model: LoadedModel, default_hf_model_dir: Path) -> None:
    from_dir = load_model(ModelConfig(model=str(default_hf_model_dir), dtype="float32"))
    assert from_dir.arch.architecture == gguf_model.arch.architecture == "LlamaForCausalLM"
    assert from_dir.arch.num_hidden_layers == 30 and from_dir.arch.tie_word_embeddings
    seqs = make_sequences(gguf_model.arch.vocab_size, seed=9)
    ours_gguf = run_scenario(gguf_model.model, _kv(gguf_model), seqs)
    seqs = make_sequences(gguf_model.arch.vocab_size, seed=9)
    ours_dir = run_scenario(from_dir.model, _kv(from_dir), seqs)
    ref = {name: torch.cat([logits for _, logits in chunks]) for name, chunks in ours_gguf.items()}
    flat = {name: torch.cat([logits for _, logits in chunks]) for name, chunks in ours_dir.items()}
    for name in ref:
        diff = (ref[name] - flat[name]).abs().max().item()
        assert diff < 1e-4, f"{name}: HF-dir vs GGUF max |logit diff| {diff:.2e}"
