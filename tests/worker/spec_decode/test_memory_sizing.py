"""The draft model's KV cache counts in the runner's KV sizing: with a draft model,
the target and draft caches together stay within ``memory_fraction`` of the free
memory (here a fixed, pretended amount), so each gets about half the blocks when
the model drafts for itself; n-gram speculation has no cache and changes nothing."""

from __future__ import annotations

import psutil
import pytest
import torch

from tests.conftest import default_gguf_path
from tokenloom.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from tokenloom.model.arch_reader import load_arch_config
from tokenloom.model.kv_cache import kv_cache_bytes_per_block
from tokenloom.worker.model_runner import ModelRunner

pytestmark = pytest.mark.e2e

BLOCK = 16
FRACTION = 0.5
TARGET_BLOCKS = 400  # what the pretended memory holds for the target alone
MAX_SEQS = 16


def _bytes(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for pair in caches for t in pair)


def _runner(spec: SpeculativeConfig | None) -> ModelRunner:
    return ModelRunner(
        ModelConfig(dtype="float32", max_model_len=512),
        CacheConfig(block_size=BLOCK, memory_fraction=FRACTION),
        SchedulerConfig(max_num_seqs=MAX_SEQS, speculative_config=spec),
    )


def test_draft_kv_cache_shares_the_memory_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    arch = load_arch_config(default_gguf_path())
    per_block = kv_cache_bytes_per_block(arch, BLOCK, torch.float32)
    free = int(TARGET_BLOCKS * per_block / FRACTION)
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=free))

    plain = _runner(None)
    assert plain.num_blocks == TARGET_BLOCKS
    ngram = _runner(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    assert ngram.num_blocks == TARGET_BLOCKS

    spec = SpeculativeConfig(
        method="draft_model", model=str(default_gguf_path()), num_speculative_tokens=4
    )
    runner = _runner(spec)
    assert runner.speculator is not None and runner.speculator.draft_model is not None
    draft = runner.speculator.draft_model
    total = _bytes(runner.kv_caches) + _bytes(draft.kv_caches)
    assert total <= free * FRACTION
    # Every target block has its draft copy (the same size here), the draft its
    # scratch blocks, and what is left of the budget is less than one block pair.
    scratch = MAX_SEQS * draft.scratch_blocks_per_slot
    assert draft.kv_caches[0][0].shape[0] == runner.num_blocks + scratch
    assert runner.num_blocks == (TARGET_BLOCKS - scratch) // 2
    assert free * FRACTION - total < 2 * per_block
