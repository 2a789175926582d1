"""``load_model`` decides the forward plan from the model it loaded, logs it and
sets the model up for it; ``TOKENLOOM_FORWARD_PLAN`` changes what runs."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from tests.model.harness import BlockAllocator, Seq, run_step
from tests.model.test_huge_pages import mapping_flags
from tests.quantization.blocks import write_tiny_gguf
from tokenloom.config import ModelConfig
from tokenloom.model.arch_reader import load_arch_config
from tokenloom.model.decoder_stack import DecoderStack
from tokenloom.model.kv_cache import allocate_kv_caches
from tokenloom.model.layers import GatedMLP, RMSNorm
from tokenloom.model.packed_linear import PackedLinear
from tokenloom.model.panel_linear import PanelEmbedding, PanelLinear
from tokenloom.model.registry import model_class
from tokenloom.model_loader.forward_plan import ENV, decide_plan
from tokenloom.model_loader.loader import LoadedModel, apply_plan, load_model, plan_inputs
from tokenloom.quantization.linear import QuantLinear

MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "tiny.gguf"
    write_tiny_gguf(path, {"token_embd": T.Q8_0, **dict.fromkeys(MATRICES, T.Q4_K)})
    return path


def choices(loaded: LoadedModel) -> tuple[str, str, str, str]:
    plan = loaded.plan
    return plan.matmul, plan.layer_ops, plan.attention, plan.decoder


def fused(loaded: LoadedModel) -> set[bool]:
    """Whether the modules run the native layer ops, as a set over all of them."""
    modules = loaded.model.modules()
    return {m.kernels is not None for m in modules if isinstance(m, (RMSNorm, GatedMLP))}


def one_step(loaded: LoadedModel) -> torch.Tensor:
    """Logits of a 9-token prompt and a decode after it, as the runner would run them."""
    caches = allocate_kv_caches(loaded.arch, 4, 16, torch.float32, loaded.device)
    allocator = BlockAllocator(16)
    seq = Seq(list(range(100, 110)))
    first = run_step(loaded.model, caches, allocator, [(seq, 9)], loaded.attention_op)
    second = run_step(loaded.model, caches, allocator, [(seq, 1)], loaded.attention_op)
    return torch.cat(first + second)


def test_the_plan_is_logged_and_the_model_set_up_for_it(
    tiny_gguf: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="tokenloom.model_loader.loader"):
        loaded = load_model(ModelConfig(model=str(tiny_gguf)))
    assert choices(loaded) == ("native", "native", "native", "stack")
    assert f"forward plan for tiny.gguf: {loaded.plan.describe()}" in caplog.messages
    assert isinstance(loaded.model.decoder_stack, DecoderStack)
    assert loaded.attention_op is not None
    assert fused(loaded) == {True}
    assert all(m.native for m in loaded.model.modules() if isinstance(m, QuantLinear))


def test_the_override_turns_each_native_path_off(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    native = load_model(ModelConfig(model=str(tiny_gguf)))
    monkeypatch.setenv(ENV, "matmul=torch,layer_ops=torch,attention=torch,decoder=modules")
    loaded = load_model(ModelConfig(model=str(tiny_gguf)))
    assert choices(loaded) == ("torch", "torch", "torch", "modules")
    assert loaded.model.decoder_stack is None and loaded.attention_op is None
    assert fused(loaded) == {False}
    assert not any(m.native for m in loaded.model.modules() if isinstance(m, QuantLinear))
    # The same model through other kernels: the torch matmul multiplies float
    # activations where the native one rounds them to int8.
    torch.testing.assert_close(one_step(loaded), one_step(native), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_weights_are_packed_in_their_dtype_and_run_as_one_stack(
    tiny_gguf: Path, dtype: torch.dtype
) -> None:
    name = str(dtype).removeprefix("torch.")
    loaded = load_model(ModelConfig(model=str(tiny_gguf), dtype=name))
    plan = loaded.plan
    assert (plan.weights, plan.matmul, plan.decoder) == (name, "native", "stack")
    assert (loaded.dtype, loaded.weights_dtype) == (torch.float32, dtype)
    model = loaded.model
    assert isinstance(model.decoder_stack, DecoderStack)
    # Tied: the embedding gathers from the panels the head multiplies by, one copy.
    assert isinstance(model.embed_tokens, PanelEmbedding) and isinstance(
        model.logits_head, PanelLinear
    )
    assert model.embed_tokens.weight_panels is model.logits_head.weight_panels
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, PanelLinear) and qkv.weight_panels.dtype == dtype
    if sys.platform.startswith("linux"):  # streamed from huge pages (huge_pages.WeightArena)
        panels = [m.weight_panels.panels for m in model.modules() if isinstance(m, PanelLinear)]
        assert len(panels) > 1 and all("hg" in mapping_flags(p.data_ptr()) for p in panels)
    # Norms compute with the float32 activations.
    assert {p.dtype for n, p in model.named_parameters() if "norm" in n} == {torch.float32}
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert_tied_head_is_the_embedding(loaded)


def test_float32_weights_can_run_prepacked_for_mkl(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "matmul=mkl")
    loaded = load_model(ModelConfig(model=str(tiny_gguf), dtype="float32"))
    plan = loaded.plan
    assert (plan.weights, plan.matmul, plan.decoder) == ("float32", "mkl", "modules")
    assert isinstance(loaded.model.logits_head, PackedLinear)
    assert isinstance(loaded.model.layers[0].self_attn.qkv_proj, PackedLinear)
    assert loaded.model.decoder_stack is None
    assert_tied_head_is_the_embedding(loaded)


def assert_tied_head_is_the_embedding(loaded: LoadedModel) -> None:
    """The logits are the hidden states times the embedding's rows (within the
    rounding of bfloat16 activations, which the kernel may multiply in)."""
    model = loaded.model
    hidden = torch.randn(4, model.arch.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = torch.nn.functional.linear(hidden, model.embed_tokens.weight.float())
        scale = float(expected.abs().max())
        got = model.compute_logits(hidden)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-2 * scale)


def test_a_gpu_keeps_float_weights_in_nn_linear(tiny_gguf: Path) -> None:
    """Panels are the CPU kernels' layout: on another device the plan packs nothing
    (decided from the model built on the meta device, so no GPU is needed)."""
    arch = load_arch_config(tiny_gguf)
    with torch.device("meta"):
        model = model_class(arch)(arch, torch.bfloat16)
    inputs = plan_inputs(model, torch.device("cuda"), torch.bfloat16, "bfloat16", False)
    assert inputs.unavailable["matmul=native"] == "the native kernels run on the CPU"
    plan = decide_plan(inputs)
    assert plan.matmul == "torch" and plan.dtype == torch.bfloat16
    apply_plan(model, plan)
    assert isinstance(model.layers[0].mlp.down_proj, torch.nn.Linear)
    assert not any(isinstance(m, (PanelLinear, PackedLinear)) for m in model.modules())


def test_kernels_turned_off_leave_the_torch_paths(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENLOOM_CPU_KERNELS", "0")
    plan = load_model(ModelConfig(model=str(tiny_gguf), dtype="float32")).plan
    assert (plan.layer_ops, plan.attention) == ("torch", "torch")
    assert "layer_ops=native: TOKENLOOM_CPU_KERNELS=0 turns the native kernels off" in (
        plan.fallbacks
    )


def test_an_override_that_cannot_run_stops_the_load(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "matmul=torch,decoder=stack")
    with pytest.raises(ValueError, match=f"{ENV}: decoder=stack cannot run here"):
        load_model(ModelConfig(model=str(tiny_gguf), dtype="float32"))
