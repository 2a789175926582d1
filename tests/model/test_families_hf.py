"""Tiny random models of the families beyond Llama (Qwen3, Gemma 2, Gemma 3,
Phi-3) and the RoPE scaling variants (YaRN, dynamic, longrope) must give
transformers' logits and greedy tokens through our paged forward: chunked
prefill, a prefix-cache hit, ragged decodes (``scenario``), on the torch path and
on the native kernel where it applies. Gemma's sliding window (8) is shorter than
the longest sequence (23 tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen3Config,
)

from tests.model.scenario import BLOCK_SIZE, make_sequences, max_abs_diff, run_scenario
from tokenloom.config import ModelConfig
from tokenloom.model.kv_cache import allocate_kv_caches
from tokenloom.model_loader.loader import load_model
from tokenloom.ops.cpu_kernels import paged_attention_op
from tokenloom.ops.cuda import layer_ops as triton_layer_ops

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
WINDOW = 8
# Phi-3 derives head_dim from hidden_size / num_attention_heads.
PHI3 = {**{k: v for k, v in COMMON.items() if k != "head_dim"}, "hidden_size": 128}
SHORT = [1.0, 1.5, 2.0, 3.0, 1.2, 1.1, 4.0, 1.0]
LONG = [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]


def _cases() -> dict[str, PretrainedConfig]:
    return {
        "qwen3": Qwen3Config(**COMMON, tie_word_embeddings=False),
        "gemma2": Gemma2Config(
            **COMMON,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,  # small caps so that capping changes the result
            final_logit_softcapping=2.0,
        ),
        "gemma3": Gemma3TextConfig(
            **COMMON,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        ),
        "phi3_longrope_partial": Phi3Config(
            **PHI3,
            original_max_position_embeddings=64,  # longer than every sequence: short factors
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": SHORT,
                "long_factor": LONG,
            },
        ),
        "phi3_sliding": Phi3Config(**PHI3, sliding_window=WINDOW),
        # every layer windowed (it used to be served by capping the context instead)
        "mistral_sliding": MistralConfig(**COMMON, sliding_window=WINDOW),
        "llama_yarn": LlamaConfig(
            **COMMON,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            },
        ),
    }


def _random_hf_model(config: PretrainedConfig, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.3, 0.3) if "gemma" in config.model_type else param.uniform_(
                    0.7, 1.3
                )
            else:
                param.normal_(0.0, 0.1)
    return model.eval()


def _full_forward(hf_model: torch.nn.Module, seqs: dict) -> dict[str, torch.Tensor]:
    with torch.inference_mode():
        return {
            name: hf_model(torch.tensor([seq.tokens])).logits[0].float()
            for name, seq in seqs.items()
        }


def _token_by_token(hf_model: torch.nn.Module, seqs: dict, prefill: int) -> dict:
    """transformers' cached generation: the first ``prefill`` tokens in one forward,
    then one token per forward, as when it decodes."""
    out = {}
    with torch.inference_mode():
        for name, seq in seqs.items():
            ids = torch.tensor([seq.tokens])
            n = min(prefill, ids.shape[1])
            step = hf_model(ids[:, :n], use_cache=True)
            rows = [step.logits[0]]
            cache = step.past_key_values
            for i in range(n, ids.shape[1]):
                step = hf_model(ids[:, i : i + 1], past_key_values=cache, use_cache=True)
                cache = step.past_key_values
                rows.append(step.logits[0])
            out[name] = torch.cat(rows).float()
    return out


def _run_ours(path: Path, native: bool) -> tuple[dict, dict]:
    loaded = load_model(ModelConfig(model=str(path), dtype="float32"))
    native_op = None
    if native:
        native_op = paged_attention_op(loaded.device, loaded.dtype, loaded.arch.head_dim)
        assert native_op is not None, "the native attention kernel did not build"
    kv = allocate_kv_caches(loaded.arch, 32, BLOCK_SIZE, loaded.dtype, "cpu")
    seqs = make_sequences(VOCAB, seed=1)
    return seqs, run_scenario(loaded.model, kv, seqs, native_op)


def _check(ours: dict, reference: dict, label: str) -> None:
    diff = max_abs_diff(ours, reference)
    assert diff < 1e-4, f"{label}: max |logit diff| {diff:.2e}"
    for name, chunks in ours.items():
        for start, logits in chunks:
            ref = reference[name][start : start + logits.shape[0]]
            assert torch.equal(logits.argmax(-1), ref.argmax(-1)), f"{label}: greedy {name}"


@pytest.fixture(scope="module", params=list(_cases()))
def saved_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    case = request.param
    hf_model = _random_hf_model(_cases()[case], seed=sum(map(ord, case)))
    path = tmp_path_factory.mktemp(case)
    hf_model.save_pretrained(path)
    return case, hf_model, path


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_matches_transformers(saved_case, native: bool) -> None:
    case, hf_model, path = saved_case
    seqs, ours = _run_ours(path, native)
    _check(ours, _full_forward(hf_model, seqs), f"{case}/{'native' if native else 'torch'}")


@pytest.mark.parametrize("saved_case", ["gemma3", "phi3_longrope_partial"], indirect=True)
def test_triton_layer_ops_match_transformers(saved_case, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA backend's Triton layer ops (in the interpreter, ``tests/conftest.py``)
    on the families that use them most unlike Llama: Gemma 3 (norms around each
    sublayer, q/k norms, a second RoPE table for its sliding layers) and Phi-3
    (partial rotary, longrope)."""
    case, hf_model, path = saved_case
    # The projections in torch, as on CUDA (the native matmul would compute SiLU-and-mul).
    monkeypatch.setenv("TOKENLOOM_FORWARD_PLAN", "matmul=torch,layer_ops=triton")
    calls: dict[str, int] = {}
    for name in ("add_rms_norm", "rms_norm", "qk_rms_norm", "rotary_qk", "silu_and_mul"):
        kernel = getattr(triton_layer_ops, name)

        def counted(*args, _name=name, _kernel=kernel, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(triton_layer_ops, name, counted)
    seqs, ours = _run_ours(path, native=False)
    _check(ours, _full_forward(hf_model, seqs), f"{case}/triton")
    expected = {"add_rms_norm", "rms_norm", "rotary_qk"}
    expected |= {"qk_rms_norm"} if case == "gemma3" else {"silu_and_mul"}
    assert expected <= set(calls), calls


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0},
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": SHORT * 2,
            "long_factor": LONG * 2,
        },
    ],
    ids=["dynamic", "longrope"],
)
def test_length_dependent_rope_beyond_original_context(rope: dict, tmp_path: Path) -> None:
    """Past the original context (10 tokens here) dynamic NTK and longrope change
    frequencies; each position gets those of a sequence ending at it, which is what
    transformers computes when it generates token by token with its cache."""
    if rope["rope_type"] == "dynamic":
        config: PretrainedConfig = LlamaConfig(
            **{**COMMON, "max_position_embeddings": 10}, rope_parameters=rope
        )
    else:
        config = Phi3Config(**PHI3, original_max_position_embeddings=10, rope_parameters=rope)
    hf_model = _random_hf_model(config, seed=11)
    hf_model.save_pretrained(tmp_path)
    seqs, ours = _run_ours(tmp_path, native=False)
    # Prefill below the original length: transformers' dynamic table resets there.
    _check(ours, _token_by_token(hf_model, seqs, prefill=9), rope["rope_type"])
    # The scaling is in effect: a full forward over the long sequences differs.
    assert max_abs_diff(ours, _full_forward(hf_model, seqs)) > 1e-3
