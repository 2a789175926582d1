"""LoRA through ``LLM`` on the default model: one ``generate`` call mixing three
random PEFT adapters (built with peft) and the base model gives, per request,
the greedy tokens of transformers with that adapter merged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import peft
import pytest
import torch

from tests.engine.conftest import ENGINE_KWARGS
from tokenloom import LoRARequest, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
ADAPTERS = {  # name: (rank, target modules)
    "all8": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "attn4": (4, ["q_proj", "v_proj"]),
    "mlp6": (6, ["gate_proj", "up_proj", "down_proj", "o_proj"]),
}
MAX_TOKENS = 8


def _hf_base(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(default_hf_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("adapters")
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        config = peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False
        )
        model = peft.get_peft_model(_hf_base(default_hf_model_dir), config)
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if "lora_" in pname:
                    param.normal_(0.0, 0.05)
        model.save_pretrained(root / name)
    return {name: root / name for name in ADAPTERS}


def _hf_greedy(model: Any, tokenizer: Any, prompt: str) -> list[int]:
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def test_mixed_batch_matches_merged_adapters(
    adapters: dict, default_hf_model_dir: Path, tokenizer: Any
) -> None:
    from tokenloom.engine.llm import LLM

    llm = LLM(
        None,
        dtype="float32",
        enable_lora=True,
        max_loras=3,
        max_lora_rank=8,
        **ENGINE_KWARGS,
    )
    requests = [
        LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())
    ]
    per_prompt = [*requests, None]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, lora_request=per_prompt, use_tqdm=False)
    ours = [out.outputs[0].token_ids for out in outputs]

    expected = []
    for prompt, lora in zip(PROMPTS, per_prompt, strict=True):
        model = _hf_base(default_hf_model_dir)
        if lora is not None:
            model = peft.PeftModel.from_pretrained(model, lora.lora_path).merge_and_unload()
        expected.append(_hf_greedy(model, tokenizer, prompt))
    assert ours == expected
    # the adapters change the output: the base model's tokens differ for some prompt
    base = _hf_base(default_hf_model_dir)
    assert any(
        _hf_greedy(base, tokenizer, p) != e for p, e in zip(PROMPTS[:3], expected, strict=True)
    )

    # Same prompt twice with one adapter, then with the base model: the adapter's
    # blocks are reused by the adapter only.
    long_prompt = " ".join(["tokens"] * 40)
    first = llm.generate(long_prompt, params, lora_request=requests[0], use_tqdm=False)[0]
    again = llm.generate(long_prompt, params, lora_request=requests[0], use_tqdm=False)[0]
    base_out = llm.generate(long_prompt, params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and base_out.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids

    # bad adapters are refused before anything is queued
    with pytest.raises(ValueError, match="is not a directory"):
        llm.generate("x", params, lora_request=LoRARequest("nope", 9, "/no/such/adapter"))
    with pytest.raises(ValueError, match="already names"):
        llm.generate("x", params, lora_request=LoRARequest("a", 1, str(adapters["attn4"])))


def test_lora_needs_enable_lora(llm: Any, adapters: dict) -> None:
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate("x", lora_request=LoRARequest("a", 1, str(adapters["attn4"])))
