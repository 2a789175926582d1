"""Each layout and the native kernel against the dequantized reference: GGUF
blocks of every supported type (random bytes with sane fp16 scales, checked
against ``gguf.quants.dequantize``), float weights quantized to int8/int4 with
odd shapes (K not a multiple of 32, N odd), 1 to 130 rows (both kernel paths)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize

from tests.quantization.blocks import random_gguf
from tokenloom.quantization.formats import (
    GGUF_TYPES,
    QuantizedWeight,
    concat_rows,
    from_gguf,
    quantize_float,
)
from tokenloom.quantization.kernels import native_available, quant_matmul


def assert_close_fp32(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float32 accumulation error, measured against the output's scale."""
    scale = float(expected.abs().max()) + 1e-6
    torch.testing.assert_close(actual.double(), expected.double(), rtol=0, atol=2e-5 * scale)


@pytest.mark.parametrize("ggml_type", GGUF_TYPES, ids=lambda t: t.name)
def test_gguf_layouts_reproduce_dequantized_weights(ggml_type: T) -> None:
    raw = random_gguf(ggml_type, 7, 512)
    expected = dequantize(raw, ggml_type).reshape(7, 512)
    weight = from_gguf(raw, ggml_type, (7, 512))
    torch.testing.assert_close(weight.dequantize(), torch.from_numpy(expected), rtol=0, atol=1e-6)


@pytest.mark.parametrize("ggml_type", GGUF_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33, 130])
def test_native_kernel_matches_reference(ggml_type: T, rows: int) -> None:
    assert native_available()
    n, k = 37, 256 * 3
    weight = from_gguf(random_gguf(ggml_type, n, k, seed=rows), ggml_type, (n, k))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    expected = F.linear(x.double(), weight.dequantize().double()).float()
    assert_close_fp32(quant_matmul(x, weight), expected)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (5, 31), (33, 70), (129, 576)])
@pytest.mark.parametrize("rows", [1, 4, 17])
def test_float_quantization_odd_shapes(method: str, n: int, k: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(n * k + rows)
    w = torch.randn(n, k, generator=gen)
    weight = quantize_float(w, method)
    deq = weight.dequantize()
    assert deq.shape == (n, k)
    # Quantization error per element is at most half a step of its group.
    step = weight.scales.repeat_interleave(weight.group, dim=1)[:, :k]
    assert bool(((deq - w).abs() <= step / 2 + 1e-6).all())
    x = torch.randn(rows, k, generator=gen)
    expected = F.linear(x.double(), deq.double()).float()
    assert_close_fp32(quant_matmul(x, weight), expected)
    assert_close_fp32(quant_matmul(x, weight, native=False), expected)


def test_mixed_layouts_concatenate_exactly() -> None:
    """Q4_K_M files mix types inside a fused projection (q/k in Q4_K, v in Q6_K)."""
    parts = [
        from_gguf(random_gguf(t, n, 256, seed=i), t, (n, 256))
        for i, (t, n) in enumerate([(T.Q4_K, 5), (T.Q8_0, 3), (T.Q6_K, 4)])
    ]
    fused = concat_rows(parts)
    assert (fused.bits, fused.group) == (8, 16)
    torch.testing.assert_close(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(2, 256)
    assert_close_fp32(quant_matmul(x, fused), x.double() @ fused.dequantize().double().T)


def test_embedding_gather_dequantizes_only_requested_rows() -> None:
    weight: QuantizedWeight = quantize_float(torch.randn(50, 64), "int4")
    ids = torch.tensor([3, 0, 49, 3])
    torch.testing.assert_close(weight.dequantize(ids), weight.dequantize()[ids])
