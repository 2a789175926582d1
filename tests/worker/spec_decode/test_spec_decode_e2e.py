"""Speculative decoding end to end on the real default model (SmolLM2-135M-Instruct).

One runner per proposer (each load is the expensive part); on it, the same
mixed batch runs through an ``EngineCore`` without speculation (the
reference) and with it. The batch mixes requests whose text repeats (drafts
accepted), plain ones, one that cannot draft (max_tokens=1), one with stop ids
and min_tokens, one with logprobs and a seeded random one, over a KV cache
small enough that requests are preempted. Greedy outputs must be identical
token for token, and acceptance must be what the proposer implies: some
for n-gram, near all for the model as its own draft, near none for a tiny
random-weight draft with the same vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import default_gguf_path
from tokenloom.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from tokenloom.engine.core import EngineCore
from tokenloom.engine.messages import EngineCoreRequest
from tokenloom.metrics.spec_decode import SpecDecodingSummary
from tokenloom.sampling_params import SamplingParams
from tokenloom.worker.model_runner import ModelRunner

pytestmark = pytest.mark.e2e

BLOCK = 16
NUM_BLOCKS = 12  # 11 usable blocks: the batch below needs more, so requests are preempted
MAX_SEQS = 8
TEXTS = [
    "Repeat after me: the red fox ran over the hill and the red fox ran over the hill and",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Write a short poem about the sea.",
    "def square(x):\n    return x * x\n\ndef cube(x):\n    return",
    "Name three colours.",
    "The list: apple, banana, cherry. The list again: apple,",
]


def _requests(tokenizer: object, tag: str) -> list[EngineCoreRequest]:
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    params = [
        greedy,
        greedy,
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[198, 28], min_tokens=4),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=20, ignore_eos=True),
    ]
    return [
        EngineCoreRequest(
            request_id=f"{tag}-{i}",
            prompt_token_ids=tokenizer(text, add_special_tokens=False)["input_ids"],  # type: ignore[operator]
            sampling_params=p,
            eos_token_id=2,
            arrival_time=float(i),
        )
        for i, (text, p) in enumerate(zip(TEXTS, params, strict=True))
    ]


def _run(runner: ModelRunner, spec: SpeculativeConfig | None, tag: str) -> dict:
    """All requests through one EngineCore; tokens, logprob ids, finish reasons, stats."""
    from tokenloom.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_gguf_path())
    core = EngineCore(
        runner,
        CacheConfig(block_size=BLOCK, num_blocks=NUM_BLOCKS),
        SchedulerConfig(max_num_seqs=MAX_SEQS, speculative_config=spec),
    )
    for request in _requests(tokenizer, tag):
        core.add_request(request)
    tokens: dict[int, list[int]] = {}
    logprob_ids: dict[int, list[list[int]]] = {}
    reasons: dict[int, str] = {}
    summary = SpecDecodingSummary()
    preemptions = 0
    while (result := core.step()) is not None:
        outputs = result.outputs
        if outputs.scheduler_stats is not None:
            summary.add(outputs.scheduler_stats.spec_decoding_stats)
            preemptions += outputs.scheduler_stats.num_preemptions
        for out in outputs.outputs:
            index = int(out.request_id.rsplit("-", 1)[1])
            tokens.setdefault(index, []).extend(out.new_token_ids)
            for entry in out.new_logprobs or []:
                logprob_ids.setdefault(index, []).append(entry.token_ids)
            if out.finish_reason is not None:
                reasons[index] = str(out.finish_reason)
    # The runner drops the requests that finished in the last step.
    runner.execute_model(core.scheduler.schedule())
    assert runner.input_batch.num_reqs == 0
    assert core.scheduler.kv_cache_manager.usage == 0.0
    return {
        "tokens": tokens,
        "logprob_ids": logprob_ids,
        "reasons": reasons,
        "spec": summary,
        "preemptions": preemptions,
    }


def _runner(spec: SpeculativeConfig) -> ModelRunner:
    torch.manual_seed(0)
    runner = ModelRunner(
        ModelConfig(dtype="float32", max_model_len=512),
        CacheConfig(block_size=BLOCK, num_blocks=NUM_BLOCKS),
        SchedulerConfig(max_num_seqs=MAX_SEQS, speculative_config=spec),
    )
    # The draft budget fits step costs from wall-clock times; feed it a fixed cost
    # instead, so how many drafts each step takes (and so whether the batch below
    # preempts) does not depend on the machine's speed or load.
    speculator = runner.speculator
    assert speculator is not None
    observe = speculator.observe_step
    speculator.observe_step = lambda tokens, seconds: observe(tokens, 0.02 + 0.001 * tokens)  # type: ignore[method-assign]
    return runner


def _check_same_greedy_outputs(reference: dict, speculative: dict) -> None:
    for i in range(5):  # the greedy requests
        assert speculative["tokens"][i] == reference["tokens"][i], i
        assert speculative["reasons"][i] == reference["reasons"][i], i
    assert reference["preemptions"] > 0 and speculative["preemptions"] > 0
    assert len(reference["tokens"][4]) == 1
    assert speculative["logprob_ids"][3] == reference["logprob_ids"][3]
    assert len(speculative["logprob_ids"][3]) == 20
    # The seeded random request ran to its length either way.
    assert len(speculative["tokens"][5]) == len(reference["tokens"][5]) == 20


def test_ngram_greedy_outputs_identical_and_drafts_accepted() -> None:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4)
    runner = _runner(spec)
    reference = _run(runner, None, "off")
    speculative = _run(runner, spec, "ngram")
    _check_same_greedy_outputs(reference, speculative)
    summary = speculative["spec"]
    # Drafts were verified, some kept (the repetitive prompts), some rejected.
    assert summary.num_drafts >= 5, summary.describe()
    assert 3 <= summary.num_accepted_tokens < summary.num_draft_tokens, summary.describe()
    assert reference["spec"].num_drafts == 0


def _random_draft(out: Path, vocab_size: int) -> Path:
    """A tiny Llama with random weights and the target's vocabulary (HF directory)."""
    from safetensors.torch import save_file

    hidden, layers, inter = 64, 2, 128
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.5

    tensors = {"model.embed_tokens.weight": rand(vocab_size, hidden)}
    tensors["model.norm.weight"] = torch.ones(hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(hidden, hidden),
            p + "self_attn.k_proj.weight": rand(hidden // 2, hidden),
            p + "self_attn.v_proj.weight": rand(hidden // 2, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, hidden),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("draft", ["self", "random"])
def test_draft_model_greedy_outputs_identical(draft: str, tmp_path: Path) -> None:
    if draft == "self":
        path = str(default_gguf_path())
    else:
        path = str(_random_draft(tmp_path, 49152))
    spec = SpeculativeConfig(method="draft_model", model=path, num_speculative_tokens=3)
    runner = _runner(spec)
    reference = _run(runner, None, "off")
    speculative = _run(runner, spec, draft)
    _check_same_greedy_outputs(reference, speculative)
    summary = speculative["spec"]
    if draft == "self":
        assert summary.num_drafts > 10
        assert summary.acceptance_rate > 0.9, summary.describe()
    else:
        # Rejected drafts soon cut each request's budget (and the step cost then
        # declines the probes), so fewer verifications, but enough drafts to judge.
        assert summary.num_drafts >= 5, summary.describe()
        assert summary.acceptance_rate < 0.1, summary.describe()
    assert np.isfinite(summary.mean_acceptance_length)
