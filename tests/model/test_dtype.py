from __future__ import annotations

import pytest
import torch

from tokenloom.model import dtype as dtype_mod
from tokenloom.model.dtype import resolve_dtype


@pytest.mark.parametrize(
    "name,expected",
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)],
)
def test_explicit_names(name: str, expected: torch.dtype) -> None:
    assert resolve_dtype(name, "cpu") is expected


def test_unknown_name() -> None:
    with pytest.raises(ValueError, match="float64"):
        resolve_dtype("float64", "cpu")


@pytest.mark.parametrize("native,expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_on_cpu_follows_bf16_support(monkeypatch, native: bool, expected) -> None:
    monkeypatch.setattr(dtype_mod, "cpu_has_native_bf16", lambda: native)
    assert resolve_dtype("auto", "cpu") is expected


def test_auto_on_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert resolve_dtype("auto", "cuda") is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert resolve_dtype("auto", "cuda:0") is torch.float16


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
