"""The native dense kernel (``csrc/dense/dense_linear.cpp``) and its panel layout
against their torch references, on odd shapes (N not whole panels, K odd, rows
not whole tiles), for bfloat16 and float32 weights.

bfloat16 weights multiply activations rounded to bfloat16 where the library has
bf16 dot products (``dense_bf16_dot_products``), float32 ones elsewhere; either
way the reference is that product in float64, and the kernel must match it to
float32 accumulation error. Each row's result must not depend on the rows
beside it or on the thread count, to the bit. Every other built variant this
CPU runs (the widening paths of AVX-512 without BF16, and AVX2) runs this file
again in a process of its own."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.torch_threads import intra_op_threads
from tokenloom.model.panel_linear import (
    PANEL,
    DensePanels,
    PanelEmbedding,
    PanelLinear,
    pack_linears,
    pack_panels,
    use_native_matmul,
)
from tokenloom.ops import native_library
from tokenloom.ops.cpu_variants import cpu_flags, variant_named

DTYPES = (torch.bfloat16, torch.float32)


@pytest.fixture(autouse=True, scope="module")
def native_kernels() -> None:
    assert native_library.load_library() is not None, "the native library is not built"


ODD_SHAPES = [(1, 1), (17, 31), (48, 65), (100, 7), (33, 576), (960, 576), (64, 1536)]


def weight(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64."""
    bf16_dot = torch.ops.tokenloom_cpu.dense_bf16_dot_products()
    if w.dtype == torch.bfloat16 and bf16_dot:
        x = x.to(torch.bfloat16)
    return x.double() @ w.double().T


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor, k: int) -> None:
    """Within float32 accumulation error over k products, against the output's scale."""
    scale = float(expected.abs().max()) + 1e-6
    torch.testing.assert_close(actual.double(), expected, rtol=0, atol=4e-7 * k**0.5 * scale)


def test_panels_round_trip_and_pad_with_zeros() -> None:
    w = weight(17, 31, torch.bfloat16)
    panels = pack_panels(w)
    assert panels.shape == (2, 16, PANEL, 2)  # 32 rows, 16 words of 2
    dense = DensePanels.from_weight(w)
    assert torch.equal(dense.rows(), w)
    rows = torch.tensor([16, 0, 5])
    assert torch.equal(dense.rows(rows), w[rows])
    assert panels[1, :, 1:].eq(0).all() and panels[:, -1, :, 1].eq(0).all()
    assert pack_panels(weight(5, 3, torch.float32)).shape == (1, 3, PANEL, 1)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        pack_panels(w.half())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "k"), ODD_SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 9, 17, 130])
def test_kernel_matches_its_reference(dtype: torch.dtype, n: int, k: int, rows: int) -> None:
    w = weight(n, k, dtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    out = torch.ops.tokenloom_cpu.dense_linear(x, pack_panels(w), k, n)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    assert_fp32_close(out, reference(x, w), k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_rows_and_empty_batches(dtype: torch.dtype) -> None:
    w = weight(40, 64, dtype)
    wide = torch.randn(7, 100)
    x = wide[:, 10:74]  # rows 100 floats apart
    out = torch.ops.tokenloom_cpu.dense_linear(x, pack_panels(w), 64, 40)
    assert torch.equal(
        out, torch.ops.tokenloom_cpu.dense_linear(x.contiguous(), pack_panels(w), 64, 40)
    )
    empty = torch.ops.tokenloom_cpu.dense_linear(torch.empty(0, 64), pack_panels(w), 64, 40)
    assert empty.shape == (0, 40)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_does_not_depend_on_the_batch_or_the_threads(dtype: torch.dtype) -> None:
    n, k = 100, 77
    w = pack_panels(weight(n, k, dtype))
    x = torch.randn(40, k)
    alone = torch.cat(
        [torch.ops.tokenloom_cpu.dense_linear(x[i : i + 1], w, k, n) for i in range(40)]
    )
    for rows in range(1, 40):
        assert torch.equal(torch.ops.tokenloom_cpu.dense_linear(x[:rows], w, k, n), alone[:rows])
    with intra_op_threads(1):
        single = torch.ops.tokenloom_cpu.dense_linear(x, w, k, n)
    assert torch.equal(single, alone)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_few_rows_in_one_panel_tiles_sum_as_many_rows_do(dtype: torch.dtype) -> None:
    """A decode's few rows run in tiles of one panel (one or two rows of them
    requesting their panel ahead as non-temporal), many rows in wider tiles: on
    one thread, each row equals the same row among many, plainly and with the
    fused activation, a partial last panel included."""
    k = 77
    x = torch.randn(24, k, generator=torch.Generator().manual_seed(2))
    with intra_op_threads(1):
        for n in (128, 136):
            w = pack_panels(weight(n, k, dtype))
            many = torch.ops.tokenloom_cpu.dense_linear(x, w, k, n)
            for rows in range(1, 9):
                assert torch.equal(
                    torch.ops.tokenloom_cpu.dense_linear(x[:rows], w, k, n), many[:rows]
                )
        w = pack_panels(weight(128, k, dtype))
        many = torch.ops.tokenloom_cpu.dense_linear_silu(x, w, k, 128)
        for rows in range(1, 9):
            assert torch.equal(
                torch.ops.tokenloom_cpu.dense_linear_silu(x[:rows], w, k, 128), many[:rows]
            )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_many_rows_over_several_blocks_keep_each_rows_bits(
    dtype: torch.dtype, threads: int
) -> None:
    """Many rows run in blocks of rows, and on AVX2 bfloat16 weights are widened
    to float32 a unit at a time for taller tiles: each row still equals the
    same row computed alone (widened in registers), plainly and with the fused
    SwiGLU, K odd and the last unit ragged; and a matmul over other weights
    right after gets its own weights' products."""
    k, rows = 1537, 100  # about 42 rows a block
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(6))
    with intra_op_threads(threads):
        # 13: one unit, which both weights' matmuls widen first
        for n, silu in ((77, False), (13, False), (96, True)):
            ops = torch.ops.tokenloom_cpu
            matmul = ops.dense_linear_silu if silu else ops.dense_linear
            for seed in (7, 8):
                plain = weight(n, k, dtype, seed)
                w = pack_panels(plain)
                many = matmul(x, w, k, n)
                if not silu:
                    assert_fp32_close(many, reference(x, plain), k)
                alone = torch.cat([matmul(x[i : i + 1], w, k, n) for i in range(rows)])
                assert torch.equal(many, alone), (n, silu)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threads", [3, 4])
@pytest.mark.parametrize("rows", [1, 3, 8, 20])  # 20: three tiles a unit
def test_decode_rows_are_exact_when_threads_take_over_each_others_runs(
    dtype: torch.dtype, threads: int, rows: int
) -> None:
    """A decode step's rows on more threads than cores: the system stops some
    threads mid-run, and the others take over the ends of their runs, whose
    units' tiles request the next unit's weights. Every output vector is still
    written, with the same bits as on one thread, plainly and with the fused
    SwiGLU (whose units interleave gate and up panels)."""
    k, n = 256, 16 * 96
    w = pack_panels(weight(n, k, dtype, seed=4))
    batches = torch.randn(40, rows, k, generator=torch.Generator().manual_seed(5))
    with intra_op_threads(1):
        expected = [torch.ops.tokenloom_cpu.dense_linear(x, w, k, n) for x in batches]
        expected_silu = [torch.ops.tokenloom_cpu.dense_linear_silu(x, w, k, n) for x in batches]
    with intra_op_threads(threads):
        for x, plain_out, silu_out in zip(batches, expected, expected_silu, strict=True):
            assert torch.equal(torch.ops.tokenloom_cpu.dense_linear(x, w, k, n), plain_out)
            assert torch.equal(torch.ops.tokenloom_cpu.dense_linear_silu(x, w, k, n), silu_out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_few_rows_split_by_vectors_between_threads(dtype: torch.dtype, threads: int) -> None:
    """A decode's few rows split the output vectors into a run per thread, whose
    end a thread done early takes over (more threads than cores make them
    uneven), each run in wide tiles and a narrower last one: whatever the split,
    each row equals the same row among many (which run in fixed units)."""
    k = 40
    x = torch.randn(24, k, generator=torch.Generator().manual_seed(3))
    with intra_op_threads(threads):
        for vecs in (1, 5, 9, 15, 22):
            for n in (16 * vecs, 16 * vecs - 3):
                plain = weight(n, k, dtype)
                w = pack_panels(plain)
                many = torch.ops.tokenloom_cpu.dense_linear(x, w, k, n)
                assert_fp32_close(many, reference(x, plain), k)
                for rows in range(1, 6):
                    assert torch.equal(
                        torch.ops.tokenloom_cpu.dense_linear(x[:rows], w, k, n), many[:rows]
                    ), (n, rows)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 4, 5, 130])  # up to 4: the whole product, then silu
def test_the_fused_activation_equals_projection_then_silu(dtype: torch.dtype, rows: int) -> None:
    n, k = 96, 40  # each half three panels
    w = pack_panels(weight(n, k, dtype))
    x = torch.randn(rows, k)
    both = torch.ops.tokenloom_cpu.dense_linear(x, w, k, n)
    expected = torch.empty(rows, n // 2)
    torch.ops.tokenloom_cpu.silu_and_mul(expected, both)
    assert torch.equal(torch.ops.tokenloom_cpu.dense_linear_silu(x, w, k, n), expected)
    torch.testing.assert_close(expected, F.silu(both[:, : n // 2]) * both[:, n // 2 :])
    with pytest.raises(RuntimeError, match="whole panels in each half"):
        torch.ops.tokenloom_cpu.dense_linear_silu(x, pack_panels(weight(80, k, dtype)), k, 80)


def test_bad_arguments_are_refused() -> None:
    w = pack_panels(weight(40, 64, torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"x must be float32 \[M, 64\]"):
        torch.ops.tokenloom_cpu.dense_linear(torch.randn(2, 63), w, 64, 40)
    with pytest.raises(RuntimeError, match="n_out 49 does not match"):
        torch.ops.tokenloom_cpu.dense_linear(torch.randn(2, 64), w, 64, 49)
    with pytest.raises(RuntimeError, match="k 80 does not match"):
        torch.ops.tokenloom_cpu.dense_linear(torch.randn(2, 80), w, 80, 40)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        torch.ops.tokenloom_cpu.dense_linear(torch.randn(2, 64), w.half(), 64, 40)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_modules_run_the_kernel_or_unpack_for_torch(dtype: torch.dtype) -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(50, 70, dtype=dtype), torch.nn.Linear(70, 30, bias=False, dtype=dtype)
    )
    weights = [model[0].weight.detach().clone(), model[1].weight.detach().clone()]
    bias = model[0].bias.detach().float()
    assert pack_linears(model) == 2
    assert isinstance(model[0], PanelLinear) and model[0].bias.dtype == torch.float32
    x = torch.randn(3, 4, 50)  # any leading shape
    native = model(x)
    first = reference(x.reshape(-1, 50), weights[0]) + bias.double()
    assert native.shape == (3, 4, 30)
    use_native_matmul(model, False)
    assert not model[0].native
    unpacked = model(x)
    expected = F.linear(
        F.linear(x.to(dtype), weights[0], bias.to(dtype)).float().to(dtype), weights[1]
    )
    torch.testing.assert_close(unpacked, expected.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(native, unpacked, rtol=2e-2, atol=2e-2)
    use_native_matmul(model, True)
    assert_fp32_close(model[0](x.reshape(-1, 50)), first, 50)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [24, 7])  # whole words, and an odd last word
def test_the_embedding_gathers_the_heads_rows(dtype: torch.dtype, k: int, native: bool) -> None:
    w = weight(37, k, dtype)
    panels = DensePanels.from_weight(w)
    embedding = PanelEmbedding(panels)
    use_native_matmul(embedding, native)
    ids = torch.tensor([[36, 0], [17, 17]])
    gathered = embedding(ids)
    assert gathered.dtype == torch.float32 and torch.equal(gathered, w[ids].float())
    assert torch.equal(embedding(ids.int()), gathered)
    assert torch.equal(embedding(ids.t()), w[ids.t()].float())  # not contiguous
    head = PanelLinear(panels)
    assert head.native_projection().forward(gathered[0]).equal(head(gathered[0]))
    # More tokens than the vocabulary has rows: a prefill's embedding.
    many = torch.arange(100) % 37
    assert torch.equal(embedding(many), w[many].float())
    if native:
        with pytest.raises(RuntimeError, match="id 37 out of the matrix's 37 rows"):
            embedding(torch.tensor([3, 37]))


def test_every_other_built_variant_passes_these_tests() -> None:
    """The library variants this process did not load (one per process: they
    register the same ops), on this file, where the CPU runs them."""
    loaded = native_library.load_library()
    assert loaded is not None
    others = [
        name
        for name in native_library.built_variants()
        if name != loaded.name and variant_named(name, platform.machine()).cpu_flags <= cpu_flags()
    ]
    for name in others:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                __file__,
                "-k",
                "not every_other_built_variant",
            ],
            env=dict(os.environ, TOKENLOOM_CPU_VARIANT=name),
            cwd=Path(__file__).resolve().parents[2],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, f"variant {name}:\n{done.stdout[-3000:]}"
