"""The real default model (float32) with a bfloat16 KV cache against the same model
with a float32 cache: greedy continuations of 18 prompts, driven through the
real scheduler and runner (native kernels where they build).

Rounding K/V to bfloat16 moves logits by a few hundredths, so greedy decoding
may pick a different token where the top two are nearly tied, after which the
continuations part. Measured here (16 tokens each): all 18 continuations
identical, logits within 0.19 of the float32 cache's. The test asserts AGREEMENT of positions and LOGITS_ATOL, with
room for the noise of other prompts but not for a broken cache (a cache that
dropped or misplaced K/V changes logits by whole units and parts at once).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.worker.test_model_runner_e2e import (
    BLOCK_SIZE,
    MAX_TOKENS,
    PLAIN,
    RUNNER_BLOCKS,
    SHARED,
    SYSTEM,
    drive,
)
from tokenloom.config import CacheConfig, ModelConfig, SchedulerConfig
from tokenloom.worker.model_runner import ModelRunner

pytestmark = pytest.mark.e2e

AGREEMENT = 0.9  # share of generated positions before the first divergence
LOGITS_ATOL = 0.5  # on positions whose contexts are still identical


def _runner(cache_dtype: str) -> ModelRunner:
    return ModelRunner(
        ModelConfig(dtype="float32", max_model_len=1024),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=RUNNER_BLOCKS, cache_dtype=cache_dtype),  # type: ignore[arg-type]
        SchedulerConfig(max_num_seqs=32),
    )


@pytest.fixture(scope="module")
def prompts(default_model_path: Path) -> list[list[int]]:
    from tokenloom.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path)
    return [
        tokenizer(t, add_special_tokens=False)["input_ids"]
        for t in [SYSTEM + s for s in SHARED] + PLAIN
    ]


def test_bfloat16_kv_cache_mostly_agrees_with_float32(prompts: list[list[int]]) -> None:
    runs = {}
    for cache_dtype in ("float32", "bfloat16"):
        runner = _runner(cache_dtype)
        assert runner.kv_cache_dtype == getattr(torch, cache_dtype)
        assert all(k.dtype == runner.kv_cache_dtype for kv in runner.kv_caches for k in kv)
        runs[cache_dtype] = drive(runner, prompts, cache_dtype, SchedulerConfig(max_num_seqs=32))
        del runner
    full, half = runs["float32"], runs["bfloat16"]
    agreeing = identical = 0
    worst = 0.0
    for i in range(len(prompts)):
        a, b = full.outputs[f"float32-{i}"], half.outputs[f"bfloat16-{i}"]
        assert len(a) == len(b) == MAX_TOKENS
        same = next((j for j in range(MAX_TOKENS) if a[j] != b[j]), MAX_TOKENS)
        agreeing += same
        identical += same == MAX_TOKENS
        # Logits at position j were computed from identical contexts for j <= same.
        checked = min(same + 1, MAX_TOKENS)
        la = torch.stack(full.logits[f"float32-{i}"][:checked])
        lb = torch.stack(half.logits[f"bfloat16-{i}"][:checked])
        worst = max(worst, float((la - lb).abs().max()))
    share = agreeing / (MAX_TOKENS * len(prompts))
    print(f"bf16 KV: {identical}/{len(prompts)} identical, {share:.1%} agree, logits {worst:.3f}")
    assert share >= AGREEMENT
    assert 0.0 < worst < LOGITS_ATOL  # > 0: the cache really was rounded


def test_auto_stores_kv_in_bfloat16_under_quantized_weights() -> None:
    """The default GGUF runs on its quantized weights with float32 activations;
    "auto" keeps its K/V in bfloat16. Dequantized to float32, it keeps float32."""
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=8)
    for dtype, expected in (("auto", torch.bfloat16), ("float32", torch.float32)):
        runner = ModelRunner(ModelConfig(dtype=dtype, max_model_len=256), cache, SchedulerConfig())
        assert runner.dtype == torch.float32
        assert runner.kv_cache_dtype == expected
        assert all(t.dtype == expected for kv in runner.kv_caches for t in kv)
