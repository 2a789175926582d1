"""MKL-prepacked linear layers give F.linear's results (the loader's use of them,
the forward plan's matmul=mkl, is tested in tests/model_loader/test_loader.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.model.packed_linear import PackedLinear, prepack_linears, prepacking_available

CPU = torch.device("cpu")


def test_prepacking_is_available_on_this_build() -> None:
    assert prepacking_available(CPU, torch.float32)
    assert not prepacking_available(CPU, torch.bfloat16)
    assert not prepacking_available(torch.device("meta"), torch.float32)


@pytest.mark.parametrize("rows", [1, 3, 16, 128, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 96, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(200, generator=g))
    packed = PackedLinear(linear.weight, linear.bias)
    x = torch.randn(rows, 96, generator=g)
    with torch.inference_mode():
        expected = F.linear(x, linear.weight, linear.bias)
        assert torch.allclose(packed(x), expected, atol=1e-4, rtol=1e-5)
        # Leading dims are flattened and restored.
        assert torch.allclose(packed(x.view(1, rows, 96))[0], expected, atol=1e-4, rtol=1e-5)


def test_prepack_linears_replaces_nested_layers_and_keeps_parameters() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 4)))
    before = dict(model.named_parameters())
    x = torch.randn(5, 8)
    with torch.inference_mode():
        expected = model(x)
        assert prepack_linears(model) == 2
        assert all(not isinstance(m, nn.Linear) for m in model.modules())
        assert torch.allclose(model(x), expected, atol=1e-5)
    after = dict(model.named_parameters())
    assert before.keys() == after.keys()
    assert all(before[name] is after[name] for name in before)
