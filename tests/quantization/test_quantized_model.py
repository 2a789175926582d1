"""Models running on quantized weights against the same weights dequantized to
float32: the default GGUF (Q4_1 layers, Q8_0 tied embedding) on >= 4,000 tokens
of local English text, tiny random-weight GGUFs for the types it lacks, and
Hugging Face checkpoints quantized at load time (int8, int4). The quantized side
is teacher-forced DECODE_ROWS tokens per forward pass, through the kernel path
decode uses (the native decoder stack, where the model qualifies), over the KV
cache dtype serving gives it by default (bfloat16)."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from tests.model.harness import BlockAllocator, Seq, run_step
from tests.model.test_huge_pages import mapping_flags
from tests.quantization.blocks import write_tiny_gguf
from tokenloom.config import ModelConfig
from tokenloom.model.dtype import resolve_kv_cache_dtype
from tokenloom.model.kv_cache import allocate_kv_caches
from tokenloom.model.panel_linear import panel_weight_bytes
from tokenloom.model.tokenizer import load_tokenizer
from tokenloom.model_loader.loader import LoadedModel, load_model
from tokenloom.ops.cpu_kernels import paged_attention_op
from tokenloom.quantization.linear import QuantEmbedding, QuantLinear, quantized_weight_bytes

NUM_TOKENS = 4096
# Nats between the float model's first and second token where greedy answers may part.
NEAR_TIE = 0.25
CHUNK = 1024  # tokens per teacher-forced sequence
# Tokens per forward pass on the quantized side: decode-sized passes, each
# attending over the KV cache the earlier ones wrote, as serving does (the
# quantized kernel itself computes the same at any row count).
DECODE_ROWS = 4
BLOCK = 16


@pytest.fixture(scope="module")
def text_ids(default_model_path: Path) -> list[int]:
    """The first NUM_TOKENS tokens of numpy's license file (English, shipped with
    a dependency, the same on every install of that version)."""
    files = importlib.metadata.distribution("numpy").files or []
    license_file = next(f for f in files if f.name == "LICENSE.txt")
    text = Path(str(license_file.locate())).read_text()
    ids = load_tokenizer(default_model_path).encode(text)
    assert len(ids) >= NUM_TOKENS
    return list(ids[:NUM_TOKENS])


def teacher_forced(
    loaded: LoadedModel, ids: list[int], step: int = CHUNK
) -> tuple[float, torch.Tensor]:
    """(perplexity of ``ids``, argmax at every position) in CHUNK-token sequences,
    ``step`` tokens per forward pass (the matmuls see that many rows), over the
    KV cache dtype ``kv_cache_dtype="auto"`` gives the model."""
    kv_dtype = resolve_kv_cache_dtype("auto", loaded.weights_dtype, loaded.quantized)
    caches = allocate_kv_caches(loaded.arch, CHUNK // BLOCK + 1, BLOCK, kv_dtype, loaded.device)
    # The runner's attention kernel: with it, decode-sized passes of a quantized
    # model run through its native decoder stack, as they do when serving.
    native_op = paged_attention_op(loaded.device, loaded.dtype, loaded.arch.head_dim)
    nll, argmax = 0.0, []
    for start in range(0, len(ids), CHUNK):
        tokens = ids[start : start + CHUNK]
        seq, allocator = Seq(tokens), BlockAllocator(BLOCK)
        logits = torch.cat(
            [
                run_step(
                    loaded.model,
                    caches,
                    allocator,
                    [(seq, min(step, len(tokens) - done))],
                    native_op,
                )[0]
                for done in range(0, len(tokens), step)
            ]
        )
        logprobs = torch.log_softmax(logits[:-1], dim=-1)
        nll -= float(logprobs.gather(1, torch.tensor(tokens[1:])[:, None]).sum())
        argmax.append(logits.argmax(-1))
    count = len(ids) - len(ids) // CHUNK
    return float(torch.tensor(nll / count).exp()), torch.cat(argmax)


def assert_matches_dequantized(
    quantized: LoadedModel, reference: LoadedModel, ids: list[int]
) -> None:
    ppl, top = teacher_forced(quantized, ids, DECODE_ROWS)
    ref_ppl, ref_top = teacher_forced(reference, ids)
    agreement = float((top == ref_top).float().mean())
    assert abs(ppl / ref_ppl - 1) <= 0.01, (ppl, ref_ppl)
    assert agreement >= 0.97, agreement


def float_weight_bytes(model: torch.nn.Module) -> int:
    """Parameters and float matrices in panels (the native kernel's layout)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + panel_weight_bytes(model)


@pytest.fixture(scope="module")
def default_quantized() -> LoadedModel:
    return load_model(ModelConfig(model=None))


def test_default_gguf_runs_quantized_in_a_quarter_of_the_memory(
    default_quantized: LoadedModel,
) -> None:
    model: Any = default_quantized.model
    assert default_quantized.dtype == torch.float32 and default_quantized.quantized
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert isinstance(model.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert model.logits_head.qweight is model.embed_tokens.qweight  # tied head, one copy
    if sys.platform.startswith("linux"):  # streamed from huge pages (huge_pages.WeightArena)
        codes = [m.qweight.qweight for m in model.modules() if isinstance(m, QuantLinear)]
        assert len(codes) > 1 and all("hg" in mapping_flags(c.data_ptr()) for c in codes)
    dequantized = load_model(ModelConfig(model=None, dtype="float32"))
    resident = quantized_weight_bytes(model) + float_weight_bytes(model)
    assert resident <= float_weight_bytes(dequantized.model) / 4


def test_default_gguf_numerics_match_dequantized(
    default_quantized: LoadedModel, text_ids: list[int]
) -> None:
    reference = load_model(ModelConfig(model=None, dtype="float32"))
    assert_matches_dequantized(default_quantized, reference, text_ids)


def test_explicit_float_dtype_dequantizes() -> None:
    loaded = load_model(ModelConfig(model=None, dtype="bfloat16"))
    assert loaded.weights_dtype == torch.bfloat16
    assert not any(isinstance(m, QuantLinear) for m in loaded.model.modules())


_ALL = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_SINGLE_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K]
# What llama.cpp's Q4_K_M does: Q4_K mostly, Q6_K for V, FFN down and the output.
_Q4_K_M = {
    **dict.fromkeys(_ALL, T.Q4_K),
    "attn_v": T.Q6_K,
    "ffn_down": T.Q6_K,
    "token_embd": T.Q4_K,
    "output": T.Q6_K,
}


@pytest.mark.parametrize(
    ("types", "tied"),
    [
        ({**dict.fromkeys(_ALL), "token_embd": t} | dict.fromkeys(_ALL, t), True)
        for t in _SINGLE_TYPES
    ]
    + [(_Q4_K_M, False)],
    ids=[t.name for t in _SINGLE_TYPES] + ["Q4_K_M-mix"],
)
def test_tiny_gguf_numerics_match_dequantized(
    types: dict[str, T], tied: bool, text_ids: list[int], tmp_path: Path
) -> None:
    """Random weights make perplexity on text meaningless as a quality measure, but
    quantized and dequantized must still agree on it and on the argmax."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, types, tied=tied)
    quantized = load_model(ModelConfig(model=str(path)))
    assert isinstance(quantized.model.layers[0].self_attn.qkv_proj, QuantLinear)
    reference = load_model(ModelConfig(model=str(path), dtype="float32"))
    ids = [i % 512 for i in text_ids]
    assert_matches_dequantized(quantized, reference, ids)
    logits = teacher_forced(quantized, ids[:CHUNK])
    assert torch.isfinite(torch.tensor(logits[0]))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_hf_checkpoint_quantized_at_load_time(
    method: str, default_hf_model_dir: Path, text_ids: list[int]
) -> None:
    quantized = load_model(ModelConfig(model=str(default_hf_model_dir), quantization=method))
    model: Any = quantized.model
    assert isinstance(model.layers[0].mlp.gate_up_proj, QuantLinear)
    bits = 8 if method == "int8" else 4
    assert model.layers[0].mlp.gate_up_proj.qweight.bits == bits
    reference = load_model(ModelConfig(model=str(default_hf_model_dir), dtype="float32"))
    ppl, top = teacher_forced(quantized, text_ids[:CHUNK])
    ref_ppl, ref_top = teacher_forced(reference, text_ids[:CHUNK])
    # Requantizing changes the weights (these are the Q4_1 file's, dequantized):
    # int8 measured 1.5% off in perplexity, int4 more.
    assert abs(ppl / ref_ppl - 1) <= (0.03 if method == "int8" else 0.10), (ppl, ref_ppl)
    assert float((top == ref_top).float().mean()) >= (0.90 if method == "int8" else 0.80)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"quantization": "fp8"}, "quantization"),
        ({"quantization": "int8"}, "quantization"),  # a GGUF is quantized already
        ({"quantization": "gguf", "dtype": "bfloat16"}, "dtype"),
    ],
)
def test_bad_quantization_is_refused_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        load_model(ModelConfig(model=None, **kwargs))


def test_lora_on_a_quantized_base_is_refused(default_quantized: LoadedModel) -> None:
    from tokenloom.config import LoRAConfig
    from tokenloom.model.lora import LoRAManager

    with pytest.raises(ValueError, match="enable_lora"):
        LoRAManager(default_quantized.model, LoRAConfig())  # type: ignore[arg-type]


def test_greedy_generation_follows_dequantized_model() -> None:
    """Greedy answers on the quantized weights against the dequantized float32
    model's, compared as vLLM compares a quantized model with its reference
    (check_logprobs_close), with top 2 instead of its top 5: the tokens agree up
    to the first position where they differ, and there each model's token is
    the other's runner-up, with the float model's two within NEAR_TIE nats, a
    tie that the activations' int8 rounding may tip either way."""
    from tokenloom.engine.llm import LLM
    from tokenloom.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    kwargs: dict[str, Any] = {"num_blocks": 64, "max_model_len": 256, "log_stats": False}
    quantized, reference = (
        [
            out.outputs[0]
            for out in LLM(None, dtype=dtype, **kwargs).generate(prompts, params, use_tqdm=False)
        ]
        for dtype in ("auto", "float32")
    )
    for ours, theirs in zip(quantized, reference, strict=True):
        assert ours.logprobs is not None and theirs.logprobs is not None
        pairs = zip(ours.token_ids, theirs.token_ids, strict=True)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        if first is None:
            continue
        mine, other = ours.token_ids[first], theirs.token_ids[first]
        where = f"position {first}: ours {mine}, float32's {other}"
        assert mine in theirs.logprobs[first] and other in ours.logprobs[first], where
        assert theirs.logprobs[first][other] - theirs.logprobs[first][mine] < NEAR_TIE
