"""The draft-model proposer on the real default model, driven next to the target
runner: with the target as its own draft, its greedy drafts are the target's own
next tokens, which only holds if its KV cache follows the target's block tables
through chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import default_gguf_path
from tokenloom.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from tokenloom.core.sched.scheduler import Scheduler
from tokenloom.request import Request
from tokenloom.sampling_params import SamplingParams
from tokenloom.worker.model_runner import ModelRunner
from tokenloom.worker.spec_decode.draft_model import DraftModelProposer

pytestmark = pytest.mark.e2e

K = 3
BLOCK = 16
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 3 + "Repeat the sentence:",
    "List the planets of the solar system in order from the sun:",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "The quick brown fox jumps over the lazy dog. " * 3 + "Now in French:",
]


@pytest.fixture(scope="module")
def models() -> tuple[ModelRunner, DraftModelProposer]:
    runner = ModelRunner(
        ModelConfig(dtype="float32", max_model_len=512),
        CacheConfig(block_size=BLOCK, num_blocks=64),
        SchedulerConfig(max_num_seqs=8),
    )
    config = SpeculativeConfig(
        method="draft_model", num_speculative_tokens=K, model=str(default_gguf_path())
    )
    proposer = DraftModelProposer(
        config, runner.model_config, runner.arch.vocab_size, BLOCK, 8, 512
    )
    proposer.allocate_kv_cache(runner.num_blocks)
    return runner, proposer


def _drive(
    runner: ModelRunner,
    proposer: DraftModelProposer,
    num_blocks: int,
    batched_tokens: int,
    tag: str,
) -> tuple[dict[str, list[int]], dict[str, list[tuple[int, list[int]]]], int]:
    from tokenloom.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(Path(default_gguf_path()))
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=batched_tokens),
        CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
        runner.max_model_len,
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, text in enumerate(PROMPTS):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        scheduler.add_request(Request(f"{tag}-{i}", ids, params))
    outputs: dict[str, list[int]] = defaultdict(list)
    drafts: dict[str, list[tuple[int, list[int]]]] = defaultdict(list)
    preemptions = 0
    batch = runner.input_batch
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        preemptions += len(out.preempted_req_ids)
        starts = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        result = runner.execute_model(out)
        if result.req_ids:
            ids = result.req_ids
            slots = np.array([batch.req_id_to_index[r] for r in ids])
            start = np.array([starts[r] for r in ids])
            sampled = [bool(t) for t in result.sampled_token_ids]
            end = np.where(
                sampled, batch.num_tokens[slots], start + [out.num_scheduled_tokens[r] for r in ids]
            )
            caps = np.where(sampled, K, 0)
            proposal = proposer.propose(batch, slots, start, end, caps)
            for r, s, d in zip(ids, sampled, proposal.draft_token_ids, strict=True):
                assert len(d) == (K if s else 0)
                if s:
                    drafts[r].append((len(outputs[r]) + 1, d))
        for engine_outputs in scheduler.update_from_output(out, result).values():
            for o in engine_outputs.outputs:
                outputs[o.request_id].extend(o.new_token_ids)
    runner.execute_model(scheduler.schedule())  # the runner drops the finished requests
    return outputs, drafts, preemptions


def test_self_draft_predicts_the_targets_next_tokens(
    models: tuple[ModelRunner, DraftModelProposer],
) -> None:
    """Chunked prefill (32-token steps) and preemption (12 blocks) in one run."""
    runner, proposer = models
    outputs, drafts, preemptions = _drive(runner, proposer, 12, 32, "chunked-preempting")
    assert preemptions > 0
    matched = total = 0
    for req_id, entries in drafts.items():
        final = outputs[req_id]
        assert len(final) == 24
        for num_outputs, proposed in entries:
            # Drafts follow the first num_outputs tokens (the one just sampled included).
            expected = final[num_outputs : num_outputs + K]
            for a, b in zip(proposed, expected, strict=False):
                total += 1
                matched += a == b
    assert total > 50
    assert matched / total > 0.95, (matched, total)
