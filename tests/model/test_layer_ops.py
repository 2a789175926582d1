"""The fused native layer ops (csrc/layer_ops.cpp) agree with the torch ops they
replace, and a model runs the same with and without them."""

from __future__ import annotations

from typing import cast

import pytest
import torch
import torch.nn.functional as F

from tokenloom.model.layers import RMSNorm, apply_rope
from tokenloom.model.llama import CausalLM
from tokenloom.model_loader.loader import LoadedModel
from tokenloom.ops.cpu_kernels import layer_ops_available

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _require_kernels() -> None:
    if not layer_ops_available(CPU, torch.float32):
        pytest.fail("the native CPU kernels did not build on this machine")


def test_availability_follows_device_and_dtype() -> None:
    assert not layer_ops_available(CPU, torch.bfloat16)
    assert not layer_ops_available(torch.device("meta"), torch.float32)


@pytest.mark.parametrize("hidden", [576, 70])  # 70: a tail past the last whole vector
def test_rms_norm_and_add_rms_norm(hidden: int) -> None:
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(9, hidden, generator=g) * 3
    residual = torch.randn(9, hidden, generator=g)
    weight = torch.randn(hidden, generator=g)
    out = torch.empty_like(x)
    torch.ops.tokenloom_cpu.rms_norm(out, x, weight, 1e-5)
    assert torch.allclose(out, F.rms_norm(x, (hidden,), weight, 1e-5), atol=1e-5, rtol=1e-5)

    total = x + residual
    x_in, residual_in = x.clone(), residual.clone()
    torch.ops.tokenloom_cpu.add_rms_norm(x_in, residual_in, weight, 1e-5)
    assert torch.equal(residual_in, total)
    assert torch.allclose(x_in, F.rms_norm(total, (hidden,), weight, 1e-5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("width", [1536, 40])
def test_silu_and_mul_over_a_wide_range(width: int) -> None:
    g = torch.Generator().manual_seed(width)
    gate_up = torch.randn(7, 2 * width, generator=g) * 30  # deep into both tails
    out = torch.empty(7, width)
    torch.ops.tokenloom_cpu.silu_and_mul(out, gate_up)
    expected = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    assert torch.allclose(out, expected, atol=1e-4, rtol=1e-5)


def test_denormal_results_are_flushed_to_zero() -> None:
    """As the quantized matmul's fused SwiGLU flushes them (denormals.h), whichever
    thread runs the row and whatever the caller's floating-point mode."""
    width = 16
    gate_up = torch.empty(64, 2 * width)  # 64 rows: spread over the threads
    gate_up[:, :width] = -100.0  # silu(-100) is -100 e^-87 here (e^x stops at -87): normal
    gate_up[:, width:] = 1e-3  # times 1e-3, about -1.6e-39: below float32's normal range
    out = torch.full((64, width), float("nan"))
    torch.ops.tokenloom_cpu.silu_and_mul(out, gate_up)
    assert torch.equal(out.abs(), torch.zeros(64, width))


@pytest.mark.parametrize("head_dim", [64, 40])
def test_rotary_qk_matches_apply_rope(head_dim: int) -> None:
    g = torch.Generator().manual_seed(head_dim)
    tokens, heads, kv_heads = 5, 6, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    angles = torch.rand(tokens, head_dim // 2, generator=g) * 100
    cos, sin = angles.cos(), angles.sin()
    q = torch.empty(tokens, heads, head_dim)
    k = torch.empty(tokens, kv_heads, head_dim)
    torch.ops.tokenloom_cpu.rotary_qk(q, k, qkv, cos, sin)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim)
    expected = apply_rope(qk, cos[:, None], sin[:, None])
    assert torch.allclose(q, expected[:, :heads], atol=1e-5)
    assert torch.allclose(k, expected[:, heads:], atol=1e-5)


def test_shape_errors_are_reported() -> None:
    with pytest.raises(RuntimeError, match="gate_up must be"):
        torch.ops.tokenloom_cpu.silu_and_mul(torch.empty(2, 8), torch.empty(2, 8))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.tokenloom_cpu.rms_norm(
            torch.empty(2, 8), torch.empty(2, 8, dtype=torch.float64), torch.ones(8), 1e-5
        )


def _set_fused(model: CausalLM, on: bool) -> None:
    model.use_layer_ops("native" if on else "torch")


@pytest.mark.e2e
def test_model_layers_agree_with_and_without_fused_ops(gguf_model: LoadedModel) -> None:
    """(The fused RoPE path is checked against transformers by test_llama_hf.)"""
    model = cast(CausalLM, gguf_model.model)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.kernels is not None for m in norms), (
        "the loader should enable the fused ops"
    )
    hidden = model.arch.hidden_size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, hidden, generator=g)
    layer = model.layers[0]
    outs = []
    try:
        for fused in (False, True):
            _set_fused(model, fused)
            with torch.inference_mode():
                h, residual = x.clone(), torch.randn(6, hidden, generator=g.manual_seed(1))
                normed, residual = layer.post_attention_layernorm.add_and_norm(h, residual)
                outs.append((model.norm(x), normed, residual, layer.mlp(normed)))
    finally:
        _set_fused(model, True)
    for unfused, fused in zip(outs[0], outs[1], strict=True):
        assert torch.allclose(unfused, fused, atol=1e-4, rtol=1e-4)
