"""The quantized gate_up matmul that outputs the SwiGLU activation itself
(``QuantLinear.silu_product``, the ``quant_linear_silu`` op): the same bits as the
projection followed by layer_ops' ``silu_and_mul``, for every weight layout and
activation grouping, at every tile shape; the unfused path where the halves are
not whole panels; and the Llama MLP wired to it."""

from __future__ import annotations

import pytest
import torch

from tests.quantization.blocks import LAYOUTS, random_layout
from tokenloom.model.layers import GatedMLP
from tokenloom.ops.cpu_kernels import layer_ops_available
from tokenloom.quantization.formats import quantize_float
from tokenloom.quantization.kernels import native_available, quant_matmul
from tokenloom.quantization.linear import QuantLinear
from tokenloom.quantization.panels import PanelWeight


@pytest.fixture(autouse=True)
def _native_kernels() -> None:
    assert native_available()
    assert layer_ops_available(torch.device("cpu"), torch.float32)


def projection_then_silu(x: torch.Tensor, weight: PanelWeight) -> torch.Tensor:
    gate_up = quant_matmul(x, weight)
    act = torch.empty(x.shape[0], gate_up.shape[1] // 2)
    torch.ops.tokenloom_cpu.silu_and_mul(act, gate_up)
    return act


@pytest.mark.parametrize(("bits", "group", "with_mins"), LAYOUTS)
@pytest.mark.parametrize("act_group", [8, 16])
@pytest.mark.parametrize(("n", "k"), [(32, 45), (96, 200)])
def test_fused_activation_equals_projection_then_silu(
    bits: int, group: int, with_mins: bool, act_group: int, n: int, k: int
) -> None:
    gen = torch.Generator().manual_seed(n + k + bits + group + act_group)
    weight = PanelWeight.from_rows(
        random_layout(bits, group, with_mins, "float16", n, k, gen), act_group
    )
    # Gate pre-activations of both signs and far into silu's tails.
    for rows in (1, 4, 5, 7, 8, 9, 130):  # the whole product and its pass up to 4
        x = torch.randn(rows, k, generator=gen) * 30
        x[::4] = 0
        expected = projection_then_silu(x, weight)
        fused = QuantLinear(weight).silu_product(x)
        assert fused.shape == (rows, n // 2)
        assert torch.equal(fused, expected), rows
        gate_up = quant_matmul(x, weight)
        reference = torch.nn.functional.silu(gate_up[:, : n // 2]) * gate_up[:, n // 2 :]
        torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-6)


def test_halves_that_are_not_whole_panels_run_unfused() -> None:
    """48 outputs: halves of 24, not whole panels of 16. The MLP then runs the
    projection and layer_ops' silu_and_mul; the fused op refuses the matrix."""
    gen = torch.Generator().manual_seed(3)
    weight = PanelWeight.from_rows(quantize_float(torch.randn(48, 70, generator=gen), "int4"))
    x = torch.randn(9, 70, generator=gen)
    mlp = GatedMLP(70, 24, torch.float32)
    mlp.gate_up_proj = QuantLinear(weight)
    mlp.kernels = torch.ops.tokenloom_cpu
    assert not mlp.gate_up_proj.has_silu_product
    expected = mlp.down_proj(projection_then_silu(x, weight))
    assert torch.equal(mlp(x), expected)
    with pytest.raises(RuntimeError, match="n_out a multiple of 32, got 48"):
        torch.ops.tokenloom_quant.quant_linear_silu(x, *weight.kernel_args())


def test_llama_mlp_on_quantized_weights_uses_the_fused_activation() -> None:
    """The MLP's output is down(silu_and_mul(gate_up(x))) bit for bit, and its
    gate_up matmul's [T, 2I] product is never computed."""
    gen = torch.Generator().manual_seed(5)
    mlp = GatedMLP(64, 96, torch.float32)
    mlp.gate_up_proj = QuantLinear(
        PanelWeight.from_rows(quantize_float(torch.randn(192, 64, generator=gen), "int4"), 16)
    )
    mlp.down_proj = QuantLinear(
        PanelWeight.from_rows(quantize_float(torch.randn(64, 96, generator=gen), "int8"))
    )
    mlp.kernels = torch.ops.tokenloom_cpu
    assert mlp.gate_up_proj.has_silu_product
    x = torch.randn(11, 64, generator=gen)
    expected = mlp.down_proj(projection_then_silu(x, mlp.gate_up_proj.qweight))
    calls: list[int] = []
    mlp.gate_up_proj.register_forward_hook(lambda *_: calls.append(1))
    assert torch.equal(mlp(x), expected)
    assert not calls
