"""Prefix caching, speculative decoding, structured outputs and LoRA on every device
this machine has: the CPU always, and CUDA where a GPU is present (the GPU check,
``benchmarks/gpu/check.sh``, runs this module there), else the CPU again with the
CUDA backend's Triton attention and layer ops in the interpreter.

A small random Llama with the default model's tokenizer, in float32, so that
greedy tokens compare exactly: against transformers on the same device (prefix
hits, LoRA with the adapter merged into the weights), against the engine without
the feature (speculative decoding), and against the constraint (structured
outputs). ``TOKENLOOM_TEST_TOKENIZER`` names a tokenizer directory where the
default model is not installed (the GPU machine).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from tokenloom.engine.llm import LLM
from tokenloom.lora_request import LoRARequest
from tokenloom.metrics.spec_decode import SpecDecodingSummary
from tokenloom.sampling_params import SamplingParams
from tokenloom.structured_output import StructuredOutputsParams

# Without a GPU, "cpu+triton" runs the CPU with the CUDA backend's attention and
# layer ops (the Triton kernels, in Triton's interpreter), the part of the CUDA path
# the CPU can run.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else ["cpu+triton"])
MAX_TOKENS = 12
LORA_RANK = 4
LORA_TARGETS = ("q_proj", "v_proj", "down_proj")


@pytest.fixture(scope="module", params=DEVICES)
def device(request: pytest.FixtureRequest) -> Iterator[str]:
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "cpu+triton":
            patch.setenv("TRITON_INTERPRET", "1")
            patch.setenv("TOKENLOOM_FORWARD_PLAN", "attention=triton,layer_ops=triton")
        yield request.param.removesuffix("+triton")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama (hidden 128, the default tokenizer's vocabulary)."""
    out = tmp_path_factory.mktemp("tiny-llama")
    given = os.environ.get("TOKENLOOM_TEST_TOKENIZER")
    if given:
        tokenizer = AutoTokenizer.from_pretrained(given)
    else:
        from tokenloom.default_model import default_model_path

        gguf = default_model_path()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # spread the logits, so greedy ties are unlikely
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _engine(model_dir: Path, device: str, **kwargs: Any) -> LLM:
    return LLM(
        str(model_dir),
        device=device,
        dtype="float32",
        num_blocks=256,
        max_model_len=256,
        log_stats=False,
        **kwargs,
    )


def _hf_greedy(model: Any, prompt: list[int], device: str) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1000, 30000, (length,), generator=generator).tolist() for _ in range(count)
    ]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(model_dir: Path, device: str) -> LLM:
    return _engine(model_dir, device)


def test_prefix_cache_hits_give_transformers_tokens(llm: LLM, model_dir: Path, device: str) -> None:
    """The second prompt shares 40 tokens (two and a half blocks) with the first:
    its tokens come from the cache, and the outputs are transformers'."""
    first, tail = _prompts(2, 40, seed=1)
    second = first + tail[:9]
    outputs = [llm.generate([prompt], GREEDY, use_tqdm=False)[0] for prompt in (first, second)]
    assert outputs[1].num_cached_tokens == 32  # whole blocks of 16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    for prompt, output in zip((first, second), outputs, strict=True):
        assert list(output.outputs[0].token_ids) == _hf_greedy(model, prompt, device)


def test_speculative_decoding_keeps_the_greedy_tokens(
    llm: LLM, model_dir: Path, device: str
) -> None:
    """Prompt lookup (ngram) and a draft model (the model itself, so every draft
    is accepted) change how tokens are computed, never which."""
    # Repetitive prompts, so the n-gram proposer finds drafts.
    prompts = [(p * 4)[:48] for p in _prompts(3, 12, seed=2)]
    plain = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    configs = {
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        },
        "draft_model": {
            "method": "draft_model",
            "model": str(model_dir),
            "num_speculative_tokens": 3,
        },
    }
    for name, config in configs.items():
        spec = _engine(model_dir, device, speculative_config=config)
        summary = SpecDecodingSummary()
        spec.stat_loggers.append(_SpecRecorder(summary))
        outputs = spec.generate(prompts, GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == plain, name
        assert summary.num_accepted_tokens >= 3, (name, summary.describe())
        if name == "draft_model":
            assert summary.num_accepted_tokens == summary.num_draft_tokens, summary.describe()
        del spec


class _SpecRecorder:
    """A stat logger that adds up the steps' draft statistics."""

    def __init__(self, summary: SpecDecodingSummary) -> None:
        self.summary = summary

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.summary.add(scheduler_stats.spec_decoding_stats)


def test_structured_outputs_follow_their_constraint(llm: LLM) -> None:
    """Random weights say nothing sensible: every output is what the grammar allows."""
    pattern = r"(yes|no)-[0-9]{3}"
    choices = ["alpha", "beta", "gamma"]
    sampled = dict(temperature=1.0, max_tokens=24, seed=7)
    outputs = llm.generate(
        [[1000 + i for i in range(8)]] * 3,
        [
            SamplingParams(**sampled, structured_outputs=StructuredOutputsParams(regex=pattern)),
            SamplingParams(**sampled, structured_outputs=StructuredOutputsParams(choice=choices)),
            SamplingParams(
                **sampled,
                structured_outputs=StructuredOutputsParams(
                    json={
                        "type": "object",
                        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
                        "required": ["ok", "n"],
                        "additionalProperties": False,
                    },
                    disable_any_whitespace=True,
                ),
            ),
        ],
        use_tqdm=False,
    )
    texts = [o.outputs[0].text for o in outputs]
    assert re.fullmatch(pattern, texts[0]), texts[0]
    assert texts[1] in choices, texts[1]
    value = json.loads(texts[2])
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)


def _write_adapter(model_dir: Path, out: Path, seed: int) -> dict[str, torch.Tensor]:
    """A PEFT LoRA adapter (rank 4, alpha 8) on LORA_TARGETS; returns each target
    weight's delta, scaling * B @ A, by its name in the base checkpoint."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    shapes = {"q_proj": (hidden, hidden), "v_proj": (kv, hidden), "down_proj": (hidden, inter)}
    kinds = {"q_proj": "self_attn", "v_proj": "self_attn", "down_proj": "mlp"}
    generator = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    for layer in range(config["num_hidden_layers"]):
        for target in LORA_TARGETS:
            out_features, in_features = shapes[target]
            a = torch.randn(LORA_RANK, in_features, generator=generator) * 0.1
            b = torch.randn(out_features, LORA_RANK, generator=generator) * 0.1
            module = f"model.layers.{layer}.{kinds[target]}.{target}"
            tensors[f"base_model.model.{module}.lora_A.weight"] = a
            tensors[f"base_model.model.{module}.lora_B.weight"] = b
            deltas[f"{module}.weight"] = 2.0 * b @ a  # alpha / r = 8 / 4
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": LORA_RANK,
                "lora_alpha": 2 * LORA_RANK,
                "target_modules": list(LORA_TARGETS),
                "bias": "none",
            }
        )
    )
    return deltas


def test_lora_batch_matches_merged_weights(model_dir: Path, device: str, tmp_path: Path) -> None:
    """Two adapters and the base model in one batch: each row's tokens are those of
    transformers with that adapter merged into the weights."""
    deltas = {
        name: _write_adapter(model_dir, tmp_path / name, seed) for seed, name in enumerate("ab")
    }
    engine = _engine(model_dir, device, enable_lora=True, max_lora_rank=LORA_RANK, max_loras=2)
    prompts = _prompts(3, 20, seed=3)
    loras = [
        LoRARequest("a", 1, str(tmp_path / "a")),
        None,
        LoRARequest("b", 2, str(tmp_path / "b")),
    ]
    outputs = engine.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    for prompt, lora, output in zip(prompts, loras, outputs, strict=True):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if lora is not None:
            state = model.state_dict()
            with torch.no_grad():
                for name, delta in deltas[lora.lora_name].items():
                    state[name] += delta
        expected = _hf_greedy(model.to(device), prompt, device)
        assert list(output.outputs[0].token_ids) == expected, lora
