"""What ``--dtype`` resolves to: the checkpoint's own dtype where the hardware
computes in it (bfloat16 also where the matmul widens it per tile), float32
where the CPU cannot multiply 16-bit floats, float16 converted to bfloat16 where
the CPU has no float16 arithmetic."""

from __future__ import annotations

import pytest
import torch

from tokenloom.model import dtype as dtype_mod
from tokenloom.model.dtype import resolve_dtype, resolve_kv_cache_dtype

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Set what this CPU multiplies natively: cpu(bf16=..., fp16=...)."""

    def set_cpu(bf16: bool, fp16: bool = False) -> None:
        monkeypatch.setattr(dtype_mod, "cpu_has_native_bf16", lambda: bf16)
        monkeypatch.setattr(dtype_mod, "cpu_has_native_fp16", lambda: fp16)

    return set_cpu


@pytest.mark.parametrize("name,expected", [("float32", FP32), ("bfloat16", BF16)])
@pytest.mark.parametrize("bf16", [True, False])
def test_explicit_names_are_honoured(cpu, name: str, expected: torch.dtype, bf16: bool) -> None:
    cpu(bf16)
    assert resolve_dtype(name, "cpu", "float16") == (expected, "as given")


def test_float16_needs_float16_arithmetic_else_becomes_bfloat16(cpu) -> None:
    cpu(bf16=True, fp16=True)
    assert resolve_dtype("float16", "cpu").dtype is FP16
    cpu(bf16=True)
    dtype, why = resolve_dtype("float16", "cpu")
    assert dtype is BF16 and "no float16 arithmetic" in why


def test_unknown_name() -> None:
    with pytest.raises(ValueError, match="float64"):
        resolve_dtype("float64", "cpu")


@pytest.mark.parametrize(
    "checkpoint,bf16,fp16,expected,why",
    [
        ("bfloat16", True, False, BF16, "the checkpoint's dtype"),
        ("bfloat16", False, False, FP32, "no bfloat16 dot products"),
        ("float32", True, False, FP32, "the checkpoint's dtype"),
        ("float32", False, False, FP32, "the checkpoint's dtype"),
        ("float16", True, True, FP16, "the checkpoint's dtype"),
        ("float16", True, False, BF16, "converted: this CPU has no float16 arithmetic"),
        ("float16", False, False, FP32, "no bfloat16 dot products"),
        (None, True, False, BF16, "the checkpoint names no dtype"),
        (None, False, False, FP32, "the checkpoint names no dtype"),
    ],
)
def test_auto_on_cpu_keeps_the_checkpoint_dtype_where_the_cpu_computes_in_it(
    cpu, checkpoint: str | None, bf16: bool, fp16: bool, expected: torch.dtype, why: str
) -> None:
    cpu(bf16, fp16)
    resolved = resolve_dtype("auto", "cpu", checkpoint)
    assert resolved.dtype is expected
    assert why in resolved.why


@pytest.mark.parametrize(
    "checkpoint,expected,why",
    [
        ("bfloat16", BF16, "widened to float32 per tile"),
        ("float16", FP32, "no bfloat16 dot products"),  # to bfloat16 would round it
        (None, FP32, "the checkpoint names no dtype"),
    ],
)
def test_auto_keeps_bfloat16_where_the_matmul_widens_it(
    cpu, checkpoint: str | None, expected: torch.dtype, why: str
) -> None:
    cpu(bf16=False)
    resolved = resolve_dtype("auto", "cpu", checkpoint, widens_bf16=True)
    assert resolved.dtype is expected
    assert why in resolved.why
    assert resolve_dtype("float32", "cpu", checkpoint, widens_bf16=True).dtype is FP32


def test_auto_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert resolve_dtype("auto", "cuda").dtype is BF16
    assert resolve_dtype("auto", "cuda", "float16").dtype is FP16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert resolve_dtype("auto", "cuda:0", "bfloat16").dtype is FP16


@pytest.mark.parametrize(
    "flags,capability,expected",
    [
        ("fpu avx2 avx512f avx512_vnni", "AVX512", False),
        ("fpu avx2 avx512f avx512_bf16", "AVX512", True),
        ("fpu avx2 amx_tile amx_bf16", "AVX512", True),
        ("fpu avx2", "AVX2", False),
        ("fpu avx2", "AMX", True),
    ],
)
def test_cpu_bf16_detection(flags: str, capability: str, expected: bool) -> None:
    cpuinfo = f"processor\t: 0\nflags\t\t: {flags}\n"
    assert dtype_mod.cpu_has_native_bf16(cpuinfo=cpuinfo, capability=capability) is expected


@pytest.mark.parametrize(
    "flags,expected",
    [
        ("fpu avx2 avx512f avx512_bf16", False),
        ("avx512_fp16 avx512_bf16", True),
        ("amx_fp16", True),
    ],
)
def test_cpu_fp16_detection(flags: str, expected: bool) -> None:
    assert dtype_mod.cpu_has_native_fp16(cpuinfo=f"flags\t\t: {flags}\n") is expected


def test_the_kv_cache_follows_the_weights() -> None:
    assert resolve_kv_cache_dtype("auto", BF16) is BF16
    assert resolve_kv_cache_dtype("auto", FP32) is FP32
    assert resolve_kv_cache_dtype("auto", FP32, quantized=True) is BF16
    assert resolve_kv_cache_dtype("float32", BF16) is FP32
