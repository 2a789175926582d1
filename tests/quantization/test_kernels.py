"""Each layout and the native kernel against its references: GGUF blocks of every
supported type (random bytes with sane fp16 scales, checked against
``gguf.quants.dequantize``), float weights quantized to int8/int4, and every
(bits, group, mins) layout with random codes, on odd shapes (K not a multiple
of 32, N odd) and 1 to 130 rows.

The native kernel quantizes the activations to int8 per 8 or 16 columns (the
matrix's act_group) at every row count, so it is compared exactly (float64, 1e-4 relative) with a reference that
quantizes them the same way, and with the dequantized float reference within the
error that activation rounding can cause (half a step per element); the torch
fallback matches the dequantized reference to float32 summation order. Each
activation row's result must not depend on the batch it is in, to the bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize

from tests.quantization.blocks import LAYOUTS, random_gguf, random_layout
from tests.torch_threads import intra_op_threads
from tokenloom.model.panel_linear import use_native_matmul
from tokenloom.quantization.formats import (
    GGUF_TYPES,
    QuantizedWeight,
    concat_rows,
    from_gguf,
    quantize_float,
)
from tokenloom.quantization.kernels import native_available, quant_matmul
from tokenloom.quantization.linear import QuantEmbedding
from tokenloom.quantization.panels import PANEL, PanelWeight, act_group_for

ACT_GROUPS = (8, 16)  # activation columns per int8 scale a matrix may ask for


def assert_close_fp32(actual: torch.Tensor, expected: torch.Tensor, tol: float = 2e-5) -> None:
    """Equal up to float32 accumulation error, measured against the output's scale."""
    scale = float(expected.abs().max()) + 1e-6
    torch.testing.assert_close(actual.double(), expected.double(), rtol=0, atol=tol * scale)


def quantized_activations(
    x: torch.Tensor, k_pad: int, bits: int, act_group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes with: x rounded to int8 per act_group columns
    (scale max|x| * (1 / 127), codes x * (127 / max|x|) ties to even), as float64, and half a step per element.
    For 6- and 8-bit weights a group is consecutive columns; for 4-bit ones,
    8 columns are 4i..4i+3 and 16+4i..16+4i+3 of each 32-column block (the two
    nibbles of the kernel's int32 lane), and 16 are two such, i = 2j and 2j + 1."""
    rows, k = x.shape
    padded = torch.zeros(rows, k_pad)
    padded[:, :k] = x
    order = torch.arange(k_pad)
    if bits == 4:
        within = torch.arange(32).view(2, 4, 4).transpose(0, 1).reshape(32)
        order = (order.view(-1, 32)[:, within]).reshape(k_pad)
    blocks = padded[:, order].view(rows, -1, act_group)
    peak = blocks.abs().amax(-1, keepdim=True)
    scale = peak * (1 / 127)
    inverse_scale = torch.where(
        peak > 0, torch.full_like(peak, 127).div(peak), torch.zeros_like(peak)
    )
    # The kernel's multiply is fused with its rounding: the exact product, rounded once.
    codes = torch.round(blocks.double() * inverse_scale.double()).float()
    half_step = (scale / 2).expand_as(blocks)
    inverse = torch.argsort(order)
    return (
        (codes.double() * scale.double()).reshape(rows, k_pad)[:, inverse][:, :k],
        half_step.double().reshape(rows, k_pad)[:, inverse][:, :k],
    )


def check_native(x: torch.Tensor, weight: QuantizedWeight) -> None:
    """The native kernel on ``weight``'s panel layout, with each activation
    grouping, against its exact reference, within the activation rounding's
    bound against the dequantized float reference, and row by row against itself
    on batches of one."""
    assert native_available()
    w = weight.dequantize().double()
    for act_group in ACT_GROUPS:
        panels = PanelWeight.from_rows(weight, act_group)
        torch.testing.assert_close(panels.dequantize(), weight.dequantize(), rtol=0, atol=0)
        out = quant_matmul(x, panels)
        k_pad = weight.scales.groups * weight.group
        xq, half_step = quantized_activations(x, k_pad, weight.bits, act_group)
        expected = F.linear(xq, w)
        assert_close_fp32(out.double(), expected, tol=1e-4)
        bound = F.linear(half_step, w.abs()) + 2e-5 * (float(expected.abs().max()) + 1e-6)
        assert bool(((out.double() - F.linear(x.double(), w)).abs() <= bound).all())
        for row in sorted({0, x.shape[0] // 2, x.shape[0] - 1}):
            assert torch.equal(quant_matmul(x[row : row + 1], panels)[0], out[row])


@pytest.mark.parametrize("ggml_type", GGUF_TYPES, ids=lambda t: t.name)
def test_gguf_layouts_reproduce_dequantized_weights(ggml_type: T) -> None:
    raw = random_gguf(ggml_type, 7, 512)
    expected = dequantize(raw, ggml_type).reshape(7, 512)
    weight = from_gguf(raw, ggml_type, (7, 512))
    torch.testing.assert_close(weight.dequantize(), torch.from_numpy(expected), rtol=0, atol=1e-6)


@pytest.mark.parametrize("ggml_type", GGUF_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 31, 32, 33, 130])
def test_native_kernel_matches_reference(ggml_type: T, rows: int) -> None:
    n, k = 37, 256 * 3
    weight = from_gguf(random_gguf(ggml_type, n, k, seed=rows), ggml_type, (n, k))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    check_native(x, weight)
    expected = F.linear(x.double(), weight.dequantize().double()).float()
    assert_close_fp32(quant_matmul(x, PanelWeight.from_rows(weight), native=False), expected)


@pytest.mark.parametrize(("bits", "group", "with_mins"), LAYOUTS)
@pytest.mark.parametrize("form", ["float32", "float16", "coded"])
@pytest.mark.parametrize(("n", "k"), [(1, 32), (7, 45), (37, 96), (70, 200)])
@pytest.mark.parametrize("rows", [1, 2, 4, 7, 17, 130])
def test_every_layout_on_odd_shapes(
    bits: int, group: int, with_mins: bool, form: str, n: int, k: int, rows: int
) -> None:
    """Random codes over the full range (int8 -128..127, 4 bits 0..15, 6 bits
    0..63), zero padding past K, random scales and mins in each stored form; x
    has some all-zero blocks."""
    gen = torch.Generator().manual_seed(n * k + rows + bits + group)
    weight = random_layout(bits, group, with_mins, form, n, k, gen)
    x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 10
    x[::3, :32] = 0
    check_native(x, weight)


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
    step = weight.scales.values().repeat_interleave(weight.group, dim=1)[:, :k]
    assert bool(((deq - w).abs() <= step / 2 + 1e-6).all())
    x = torch.randn(rows, k, generator=gen)
    check_native(x, weight)
    fallback = quant_matmul(x, PanelWeight.from_rows(weight), native=False)
    assert_close_fp32(fallback, F.linear(x.double(), deq.double()))


def test_q4_0_min_is_a_constant_code_on_the_shared_scale() -> None:
    """Q4_0's min (-8 d) costs no memory of its own, fused or not."""
    parts = [from_gguf(random_gguf(T.Q4_0, n, 64, seed=n), T.Q4_0, (n, 64)) for n in (3, 5)]
    for weight in [*parts, concat_rows(parts)]:
        assert weight.mins is not None
        assert weight.mins.codes is None and weight.mins.multiplier == -8.0
        assert weight.mins.base is weight.scales.base
        assert weight.nbytes == weight.qweight.numel() + weight.scales.base.numel() * 2
    torch.testing.assert_close(
        concat_rows(parts).dequantize(), torch.cat([p.dequantize() for p in parts])
    )


@pytest.mark.parametrize(
    ("types", "layout"),
    [
        ([T.Q4_K, T.Q4_K, T.Q6_K], (6, 16)),  # Q4_K_M's q, k and v
        ([T.Q4_0, T.Q5_K], (6, 32)),
        ([T.Q6_K, T.Q6_K], (6, 16)),
        ([T.Q4_K, T.Q8_0, T.Q6_K], (8, 16)),
    ],
    ids=["q4k-q6k", "q4_0-q5k", "q6k-q6k", "q4k-q8_0-q6k"],
)
def test_mixed_layouts_concatenate_exactly(types: list[T], layout: tuple[int, int]) -> None:
    """Q4_K_M files mix types inside a fused projection (q/k in Q4_K, v in Q6_K):
    they join in the narrowest layout that holds every part exactly."""
    parts = [
        from_gguf(random_gguf(t, n, 256, seed=i), t, (n, 256))
        for i, (t, n) in enumerate(zip(types, [5, 3, 4], strict=False))
    ]
    fused = concat_rows(parts)
    assert (fused.bits, fused.group) == layout
    torch.testing.assert_close(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    check_native(torch.randn(2, 256), fused)


# Bits per weight: 6-bit codes, int8 scale (and min) codes per group, fp16 bases
# per 256 columns. Q6_K's file: 6.5625; Q5_K's: 5.5 (int8 would make it 8.625).
@pytest.mark.parametrize(
    ("ggml_type", "layout_bits"),
    [(T.Q6_K, 6 + 8 / 16 + 16 / 256), (T.Q5_K, 6 + 16 / 32 + 32 / 256)],
)
def test_six_bit_layout_costs_what_the_file_does(ggml_type: T, layout_bits: float) -> None:
    """Q6_K in 6 bits costs its file's size: its min, -32 times the scale, is a
    constant code on the scale's base and codes, with no memory of its own."""
    n, k = 16, 512
    weight = from_gguf(random_gguf(ggml_type, n, k, seed=1), ggml_type, (n, k))
    assert weight.bits == 6 and weight.qhigh is not None
    if ggml_type == T.Q6_K:
        assert weight.mins is not None and weight.mins.multiplier == -32.0
        assert weight.mins.base is weight.scales.base and weight.mins.codes is weight.scales.codes
    assert weight.nbytes * 8 / (n * k) == layout_bits
    assert PanelWeight.from_rows(weight).nbytes == weight.nbytes  # 16 rows: no padding


def test_embedding_gather_dequantizes_only_requested_rows() -> None:
    weight = PanelWeight.from_rows(quantize_float(torch.randn(50, 64), "int4"))
    ids = torch.tensor([3, 0, 49, 3, 16, 47])
    torch.testing.assert_close(weight.dequantize(ids), weight.dequantize()[ids], rtol=0, atol=0)


def gathered_both_ways(
    weight: QuantizedWeight, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``QuantEmbedding``'s rows ``ids`` by the native gather and by its torch path."""
    assert native_available()
    embedding = QuantEmbedding(PanelWeight.from_rows(weight))
    native = embedding(ids)
    use_native_matmul(embedding, False)
    return native, embedding(ids)


@pytest.mark.parametrize(("bits", "group", "with_mins"), LAYOUTS)
@pytest.mark.parametrize("form", ["float32", "float16", "coded"])
@pytest.mark.parametrize(("n", "k"), [(1, 32), (7, 45), (37, 96), (70, 200)])
def test_native_embedding_gather_is_the_dequantized_rows(
    bits: int, group: int, with_mins: bool, form: str, n: int, k: int
) -> None:
    """Every layout and stored form on odd shapes, to the bit: the gather rounds
    each code times its scale before adding the min, as dequantize does."""
    gen = torch.Generator().manual_seed(n * k + bits + group)
    weight = random_layout(bits, group, with_mins, form, n, k, gen)
    ids = torch.randint(0, n, (3, 5), generator=gen)
    native, reference = gathered_both_ways(weight, ids)
    assert native.shape == (3, 5, k) and native.dtype == torch.float32
    assert torch.equal(native, reference)
    assert torch.equal(native, weight.dequantize()[ids])


@pytest.mark.parametrize("ggml_type", GGUF_TYPES, ids=lambda t: t.name)
def test_native_embedding_gather_of_gguf_types(ggml_type: T) -> None:
    """Every row of each GGUF type's layout (shared scale and min tensors, K-quant
    codes), gathered with int32 ids, a transposed view, and more ids than rows
    (a prefill's embedding); an id past the rows is refused."""
    n, k = 37, 512
    weight = from_gguf(random_gguf(ggml_type, n, k, seed=5), ggml_type, (n, k))
    every = torch.arange(n).int()
    native, reference = gathered_both_ways(weight, every)
    assert torch.equal(native, reference)
    torch.testing.assert_close(
        native,
        torch.from_numpy(dequantize(random_gguf(ggml_type, n, k, seed=5), ggml_type).reshape(n, k)),
        rtol=0,
        atol=1e-6,
    )
    grid = torch.arange(2 * n).view(2, n).t() % n
    assert torch.equal(gathered_both_ways(weight, grid)[0], reference[grid])
    embedding = QuantEmbedding(PanelWeight.from_rows(weight))
    with pytest.raises(RuntimeError, match="id 37 out of the matrix's 37 rows"):
        embedding(torch.tensor([3, 37]))


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_panel_layout_interleaves_rows_and_keeps_sharing(ggml_type: T) -> None:
    """Rows padded to whole panels with zeros, word j of row n at [n // 16, j, n % 16]."""
    n, k = 37, 256
    rows = from_gguf(random_gguf(ggml_type, n, k, seed=3), ggml_type, (n, k))
    panels = PanelWeight.from_rows(rows)
    words = rows.qweight.view(n, -1, 4)
    assert panels.qweight.shape == (3, words.shape[1], PANEL, 4)
    assert torch.equal(panels.qweight[2, 5, 4], words[36, 5])
    assert not panels.qweight[2, :, 5:].any()
    if ggml_type == T.Q6_K:
        assert rows.qhigh is not None and panels.qhigh is not None
        high = rows.qhigh.view(n, -1, 4)
        assert panels.qhigh.shape == (3, words.shape[1] // 2, PANEL, 4)
        assert torch.equal(panels.qhigh[2, 3, 4], high[36, 3])
    assert panels.scales.base.shape[::2] == (3, PANEL)
    if ggml_type == T.Q4_0:
        assert panels.mins is not None and panels.mins.base is panels.scales.base
    torch.testing.assert_close(panels.rows().dequantize(), rows.dequantize(), rtol=0, atol=0)
    assert panels.nbytes >= rows.nbytes


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_share_blocks_of_rows_and_panels_exactly(threads: int) -> None:
    """Rows enough for several L2 blocks (K = 4096 makes a block 40 rows) and
    panels enough for several chunks each: whichever thread takes a chunk, every
    output is written, right, and the same bits as one thread's."""
    gen = torch.Generator().manual_seed(11)
    weight = quantize_float(torch.randn(16 * 13 + 5, 4096, generator=gen), "int4")
    x = torch.randn(150, 4096, generator=gen)
    panels = PanelWeight.from_rows(weight)
    with intra_op_threads(1):
        single = quant_matmul(x, panels)
    with intra_op_threads(threads):
        check_native(x, weight)
        assert torch.equal(quant_matmul(x, panels), single)


@pytest.mark.parametrize("threads", [3, 4])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_decode_rows_are_exact_when_threads_take_over_each_others_runs(
    threads: int, rows: int
) -> None:
    """A decode step's rows on more threads than cores: the system stops some
    of them mid-run and the others take over the ends of their runs. Every
    panel's outputs are still written, with the same bits as on one thread."""
    gen = torch.Generator().manual_seed(12)
    weight = quantize_float(torch.randn(16 * 96 + 5, 512, generator=gen), "int4")
    panels = PanelWeight.from_rows(weight)
    batches = torch.randn(40, rows, 512, generator=gen)
    with intra_op_threads(1):
        expected = [quant_matmul(x, panels) for x in batches]
    with intra_op_threads(threads):
        for x, out in zip(batches, expected, strict=True):
            assert torch.equal(quant_matmul(x, panels), out)


@pytest.mark.parametrize("act_group", ACT_GROUPS)
def test_batch_invariance_over_every_row_count(act_group: int) -> None:
    """One row's output is bitwise the same alone and in batches of 2 to 70, in any
    position: a greedy answer must not change with the requests beside it."""
    gen = torch.Generator().manual_seed(7)
    quantized = quantize_float(torch.randn(40, 200, generator=gen), "int4")
    weight = PanelWeight.from_rows(quantized, act_group)
    probe = torch.randn(1, 200, generator=gen)
    alone = quant_matmul(probe, weight)
    for rows in (2, 5, 8, 9, 16, 31, 70):
        batch = torch.randn(rows, 200, generator=gen)
        at = rows // 2
        batch[at] = probe[0]
        assert torch.equal(quant_matmul(batch, weight)[at], alone[0]), rows


def test_only_the_mlp_projections_round_activations_per_16_columns() -> None:
    assert act_group_for("layers.0.mlp.gate_up_proj.weight") == 16
    assert act_group_for("layers.0.mlp.down_proj.weight") == 16
    for name in (
        "layers.0.self_attn.qkv_proj.weight",
        "layers.7.self_attn.o_proj.weight",
        "lm_head.weight",
        "embed_tokens.weight",
    ):
        assert act_group_for(name) == 8, name
