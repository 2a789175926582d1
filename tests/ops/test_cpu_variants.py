"""Which library variant a CPU runs, and that each variant's compiler flags use
only the instructions its CPU flags promise."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tokenloom.ops.cpu_variants import (
    X86_64_VARIANTS,
    CpuVariant,
    cpu_flags,
    select_variant,
    variant_named,
    variants_for,
)
from tokenloom.ops.native_library import choose_variant

V2 = "fpu sse sse2 pni ssse3 sse4_1 sse4_2 popcnt cx16 lahf_lm".split()
HASWELL = [*V2, *"avx avx2 bmi1 bmi2 f16c fma abm movbe xsave".split()]
ALDER_LAKE = [*HASWELL, "avx_vnni"]
SKYLAKE_X = [*HASWELL, *"avx512f avx512bw avx512cd avx512dq avx512vl".split()]
ICE_LAKE = [*SKYLAKE_X, "avx512_vnni", "avx512vbmi"]
ZEN_4 = [*ICE_LAKE, "avx512_bf16", "avx_vnni"]
ALL = [v.name for v in X86_64_VARIANTS]


def _name(variant: CpuVariant | None) -> str | None:
    return None if variant is None else variant.name


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (ZEN_4, "avx512_bf16"),
        (ICE_LAKE, "avx512_vnni"),
        (SKYLAKE_X, "avx2"),  # AVX-512 without VNNI: the quantized matmul's AVX2 path
        (ALDER_LAKE, "avx2_vnni"),
        (HASWELL, "avx2"),
        ([f for f in HASWELL if f != "fma"], None),
        (V2, None),
    ],
)
def test_the_best_variant_whose_flags_the_cpu_has(flags: list[str], expected: str | None) -> None:
    assert _name(select_variant(flags, "x86_64")) == expected


def test_only_built_variants_are_chosen() -> None:
    assert _name(select_variant(ZEN_4, "x86_64", ["avx2", "avx512_vnni"])) == "avx512_vnni"
    assert _name(select_variant(ZEN_4, "x86_64", ["avx2"])) == "avx2"
    assert select_variant(ZEN_4, "x86_64", []) is None
    assert select_variant(HASWELL, "x86_64", ["avx512_bf16"]) is None


def test_other_architectures_have_no_variant() -> None:
    assert variants_for("aarch64") == ()
    assert select_variant({"asimd", "fp"}, "aarch64") is None
    with pytest.raises(ValueError, match="unknown CPU variant 'avx2' for aarch64"):
        variant_named("avx2", "aarch64")


def test_a_forced_variant_must_be_built_and_run_on_this_cpu() -> None:
    assert _name(choose_variant(ALL, ZEN_4, "x86_64", forced="avx2")) == "avx2"
    assert _name(choose_variant(ALL, ZEN_4, "x86_64")) == "avx512_bf16"
    with pytest.raises(ValueError, match="TOKENLOOM_CPU_VARIANT: unknown CPU variant 'avx9'"):
        choose_variant(ALL, ZEN_4, "x86_64", forced="avx9")
    with pytest.raises(ValueError, match=r"avx2_vnni: that variant is not built \(built: avx2\)"):
        choose_variant(["avx2"], ZEN_4, "x86_64", forced="avx2_vnni")
    with pytest.raises(ValueError, match="avx512_bf16: this CPU lacks avx512_bf16"):
        choose_variant(ALL, ICE_LAKE, "x86_64", forced="avx512_bf16")


def test_cpu_flags_are_read_from_the_first_processor(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f\n\n"
        "processor\t: 1\nflags\t\t: fpu\n"
    )
    assert cpu_flags(cpuinfo) == {"fpu", "avx2", "avx512f"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


# The compiler's macros for instruction sets, as /proc/cpuinfo names each set.
ISA_MACROS = {
    "__SSE3__": "pni",
    "__SSSE3__": "ssse3",
    "__SSE4_1__": "sse4_1",
    "__SSE4_2__": "sse4_2",
    "__CRC32__": "sse4_2",
    "__POPCNT__": "popcnt",
    "__LAHF_SAHF__": "lahf_lm",
    "__GCC_HAVE_SYNC_COMPARE_AND_SWAP_16": "cx16",
    "__XSAVE__": "xsave",
    "__AVX__": "avx",
    "__AVX2__": "avx2",
    "__BMI__": "bmi1",
    "__BMI2__": "bmi2",
    "__LZCNT__": "abm",
    "__MOVBE__": "movbe",
    "__F16C__": "f16c",
    "__FMA__": "fma",
    "__AVXVNNI__": "avx_vnni",
    "__AVX512F__": "avx512f",
    "__AVX512BW__": "avx512bw",
    "__AVX512CD__": "avx512cd",
    "__AVX512DQ__": "avx512dq",
    "__AVX512VL__": "avx512vl",
    "__AVX512VNNI__": "avx512_vnni",
    "__AVX512BF16__": "avx512_bf16",
}
# Macros that follow from the sets above without naming one.
DERIVED = ("__BIGGEST_ALIGNMENT__", "__FP_FAST_FMA")
BASELINE_FLAGS = {"sse", "sse2"}  # x86-64 itself


def _macros(*args: str) -> set[str]:
    """The macros the C++ compiler (torch's builder uses `c++`) predefines with these flags."""
    out = subprocess.run(
        ["c++", *args, "-dM", "-E", "-x", "c++", "-"],
        input="",
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}


@pytest.mark.parametrize("variant", X86_64_VARIANTS, ids=lambda v: v.name)
def test_compile_flags_enable_exactly_the_instructions_of_the_cpu_flags(
    variant: CpuVariant,
) -> None:
    """A variant compiled for an instruction its CPU flags do not require would be
    loaded on CPUs without it and die of an illegal instruction."""
    enabled = _macros(*variant.compile_args) - _macros("-march=x86-64")
    unknown = {m for m in enabled if m not in ISA_MACROS and not m.startswith(DERIVED)}
    assert not unknown, f"map these macros to /proc/cpuinfo flags in ISA_MACROS: {unknown}"
    implied = {ISA_MACROS[m] for m in enabled if m in ISA_MACROS}
    assert implied | BASELINE_FLAGS == variant.cpu_flags
