"""The default model as a Hugging Face checkpoint in bfloat16 and in float32, served
with ``--dtype auto`` (its own dtype on this CPU, through the native kernels:
weights in panels, float32 activations, the decoder stack), against transformers
on the same checkpoint.

- bfloat16: logits within bfloat16's tolerance of transformers in bfloat16, and
  the same greedy token wherever transformers' top-2 gap exceeds it. The
  tolerance is 8% of the logits' scale: transformers' bfloat16 itself lands up
  to ~6% away from float32 arithmetic on the same bfloat16 weights (it rounds
  every activation to bfloat16; tokenloom rounds only the matmuls' inputs and
  the KV cache), so the two bfloat16 runs differ by about that much. tokenloom
  must also be the closer of the two to that float32 arithmetic.
- float32: transformers' logits to float32 accumulation error, and its greedy
  tokens everywhere but at exact ties (top two within that error, where the
  order of float32 sums decides, and the pick must be one of the two).
Teacher-forced along transformers' own greedy continuation, prompt then decodes,
as the runner schedules them; the greedy token compared at each position is the
argmax of transformers' logits there (``generate`` itself holds back the end
token until ``min_new_tokens``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model.harness import BlockAllocator, Seq, run_step
from tokenloom.config import ModelConfig
from tokenloom.model import dtype as dtype_mod
from tokenloom.model.kv_cache import allocate_kv_caches
from tokenloom.model.tokenizer import load_tokenizer
from tokenloom.model_loader.forward_plan import ENV
from tokenloom.model_loader.loader import LoadedModel, load_model

pytestmark = pytest.mark.e2e

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colours of the rainbow:",
    "Write a haiku about the sea.",
    "Translate to French: good morning",
    "What is 17 times 23?",
    "Explain photosynthesis in one sentence.",
    "<|im_start|>user\nHello, who are you?<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 12
BF16_TOLERANCE = 0.08  # of the logits' scale
FP32_ATOL = 1e-3  # logits reach ~±40 over 30 layers


@pytest.fixture(scope="module")
def bf16_dir(default_hf_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's HF checkpoint saved in bfloat16, as most are published."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("bf16")
    model = AutoModelForCausalLM.from_pretrained(default_hf_model_dir, dtype=torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(default_hf_model_dir).save_pretrained(out)
    return out


def transformers_model(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def greedy_references(
    model: torch.nn.Module, prompts: list[list[int]]
) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy continuation of each prompt and its logits over it."""
    out = []
    with torch.inference_mode():
        for ids in prompts:
            generated = model.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
            )[0].tolist()
            out.append((generated, model(torch.tensor([generated])).logits[0].float()))
    return out


def ours(loaded: LoadedModel, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Logits at positions 0 .. len(tokens) - 2: the prompt in one step, then decodes."""
    caches = allocate_kv_caches(
        loaded.arch,
        8,
        16,
        torch.bfloat16 if loaded.weights_dtype == torch.bfloat16 else torch.float32,
        "cpu",
    )
    allocator = BlockAllocator(16)
    seq = Seq(tokens)
    rows = run_step(loaded.model, caches, allocator, [(seq, prompt_len)], loaded.attention_op)
    for _ in range(len(tokens) - prompt_len - 1):
        rows += run_step(loaded.model, caches, allocator, [(seq, 1)], loaded.attention_op)
    return torch.cat(rows)


def prompt_ids(path: Path) -> list[list[int]]:
    tokenizer = load_tokenizer(path)
    return [tokenizer(p).input_ids for p in PROMPTS]


def test_auto_keeps_the_checkpoints_dtype_on_the_native_path(
    bf16_dir: Path, default_hf_model_dir: Path
) -> None:
    bf16 = load_model(ModelConfig(model=str(bf16_dir))).plan
    fp32 = load_model(ModelConfig(model=str(default_hf_model_dir))).plan
    assert (bf16.weights, bf16.dtype, bf16.matmul, bf16.decoder) == (
        "bfloat16",
        torch.float32,
        "native",
        "stack",
    )
    assert (fp32.weights, fp32.matmul, fp32.decoder) == ("float32", "native", "stack")


def test_auto_without_bf16_dot_products_keeps_bf16_only_for_the_native_matmul(
    bf16_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An AVX2 CPU: the dense kernel widens bfloat16 weights per tile (float32
    arithmetic from half the bytes), but torch's bfloat16 matmul there is many
    times slower than float32, so a model that runs torch's gets float32."""
    monkeypatch.setattr(dtype_mod, "cpu_has_native_bf16", lambda: False)
    assert load_model(ModelConfig(model=str(bf16_dir))).weights_dtype == torch.bfloat16
    lora = load_model(ModelConfig(model=str(bf16_dir)), float_weights=True)
    assert lora.weights_dtype == torch.float32 and lora.plan.matmul != "native"
    monkeypatch.setenv(ENV, "matmul=torch")
    assert load_model(ModelConfig(model=str(bf16_dir))).weights_dtype == torch.float32


def test_bf16_logits_and_greedy_tokens_follow_transformers_in_bf16(bf16_dir: Path) -> None:
    loaded = load_model(ModelConfig(model=str(bf16_dir), dtype="bfloat16"))
    assert loaded.plan.matmul == "native" and loaded.weights_dtype == torch.bfloat16
    prompts = prompt_ids(bf16_dir)
    references = greedy_references(transformers_model(bf16_dir, torch.bfloat16), prompts)
    exact = transformers_model(bf16_dir, torch.float32)  # float32 arithmetic, same weights
    compared = 0
    for ids, (tokens, reference) in zip(prompts, references, strict=True):
        logits = ours(loaded, tokens, len(ids))
        reference = reference[: logits.shape[0]]
        with torch.inference_mode():
            truth = exact(torch.tensor([tokens])).logits[0, : logits.shape[0]].float()
        tolerance = BF16_TOLERANCE * float(reference.abs().max())
        diff = float((logits - reference).abs().max())
        assert diff < tolerance, f"{ids}: max |logit diff| {diff:.3f} > {tolerance:.3f}"
        ours_error = float((logits - truth).abs().max())
        assert ours_error < float((reference - truth).abs().max()), ids
        # Greedy positions (the last prompt token's on) where transformers is sure.
        top2 = reference[len(ids) - 1 :].topk(2, dim=-1)
        sure = (top2.values[:, 0] - top2.values[:, 1]) > tolerance
        picked = logits[len(ids) - 1 :].argmax(-1)
        expected = top2.indices[:, 0]
        assert torch.equal(picked[sure], expected[sure]), ids
        compared += int(sure.sum())
    assert compared >= len(PROMPTS)  # the check compared something


def test_fp32_logits_and_greedy_tokens_equal_transformers(default_hf_model_dir: Path) -> None:
    loaded = load_model(ModelConfig(model=str(default_hf_model_dir)))
    assert (loaded.plan.weights, loaded.plan.matmul) == ("float32", "native")
    prompts = prompt_ids(default_hf_model_dir)
    references = greedy_references(transformers_model(default_hf_model_dir, torch.float32), prompts)
    compared = positions = 0
    for ids, (tokens, reference) in zip(prompts, references, strict=True):
        logits = ours(loaded, tokens, len(ids))
        diff = float((logits - reference[: logits.shape[0]]).abs().max())
        assert diff < FP32_ATOL, f"{ids}: max |logit diff| {diff:.2e}"
        # Greedy: transformers' token wherever its top two are further apart than
        # the two runs' logits can differ (2 x FP32_ATOL); at a closer tie, either.
        top2 = reference[len(ids) - 1 : logits.shape[0]].topk(2, dim=-1)
        picked = logits[len(ids) - 1 :].argmax(-1)
        expected = top2.indices[:, 0]
        sure = (top2.values[:, 0] - top2.values[:, 1]) > 2 * FP32_ATOL
        assert torch.equal(picked[sure], expected[sure]), ids
        assert (picked[~sure, None] == top2.indices[~sure]).any(-1).all(), ids
        compared += int(sure.sum())
        positions += len(picked)
    assert compared >= positions - 2, f"only {compared} of {positions} greedy positions untied"
