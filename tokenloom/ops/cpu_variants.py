"""The instruction-set variants the native CPU library is built in, and which one a
CPU runs.

``setup.py`` compiles every source of ``csrc/`` once per variant of the build
machine's architecture into ``tokenloom/_C_<variant>*.so``, with the variant's
compiler flags; at run time ``native_library`` loads the best variant whose
instructions the CPU has (as PyTorch and llama.cpp ship several builds of their
kernels). The kernels choose their code paths at compile time (``#if
__AVX512VNNI__`` and the like), so each variant is one set of paths:

- ``avx512_bf16``: AVX-512 with VNNI and BF16 (Zen 4 and later, Sapphire Rapids
  and later): bfloat16 dot products in attention over a bfloat16 cache.
- ``avx512_vnni``: AVX-512 with VNNI (Cascade Lake, Ice Lake): 512-bit vectors,
  ``vpdpbusd`` in the quantized matmul.
- ``avx2_vnni``: AVX2 with AVX-VNNI (Alder Lake and later client CPUs).
- ``avx2``: AVX2, FMA and F16C (Haswell, Zen 1 and later).

The kernels need at least AVX2 and are written with x86 intrinsics throughout
(``immintrin.h``, the MXCSR), so an older x86 CPU or another architecture has no
variant: no library is built there, and tokenloom runs its torch paths.

This module imports nothing but the standard library: ``setup.py`` runs it by
path to read the compiler flags, before the package is built.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Flags every variant is compiled with. -fopenmp only at compile time: the
# library's OpenMP calls resolve, when it is loaded, to the runtime torch
# already loaded, so its parallel regions and torch's share one thread pool.
COMMON_COMPILE_ARGS = ("-O3", "-fopenmp", "-ffp-contract=fast")


@dataclass(frozen=True)
class CpuVariant:
    name: str
    compile_args: tuple[str, ...]  # instruction-set flags for the compiler
    cpu_flags: frozenset[str]  # /proc/cpuinfo flags its code may use

    def compiler_flags(self) -> list[str]:
        """Everything a source of csrc/ is compiled with for this variant (also
        for builds of the kernels outside setup.py, such as A/B benchmarks)."""
        return [*COMMON_COMPILE_ARGS, *self.compile_args]


# The x86-64 micro-architecture levels, as /proc/cpuinfo names their features
# (lzcnt is "abm", sse3 "pni").
_X86_64_V3 = frozenset(
    "sse sse2 pni ssse3 sse4_1 sse4_2 popcnt cx16 lahf_lm "
    "avx avx2 bmi1 bmi2 f16c fma abm movbe xsave".split()
)
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

# -mprefer-vector-width=512: loops the compiler vectorizes on its own use whole
# 512-bit registers too, as the hand-written 16-float vectors do.
_AVX512 = ("-march=x86-64-v4", "-mprefer-vector-width=512")

# Best first: a CPU runs the first variant whose flags it has.
X86_64_VARIANTS = (
    CpuVariant(
        "avx512_bf16",
        (*_AVX512, "-mavx512vnni", "-mavx512bf16"),
        _X86_64_V4 | {"avx512_vnni", "avx512_bf16"},
    ),
    CpuVariant("avx512_vnni", (*_AVX512, "-mavx512vnni"), _X86_64_V4 | {"avx512_vnni"}),
    CpuVariant("avx2_vnni", ("-march=x86-64-v3", "-mavxvnni"), _X86_64_V3 | {"avx_vnni"}),
    CpuVariant("avx2", ("-march=x86-64-v3",), _X86_64_V3),
)


def variants_for(machine: str) -> tuple[CpuVariant, ...]:
    """The variants built on, and chosen among for, an architecture
    (``platform.machine()``), best first; none where the kernels have no code."""
    return X86_64_VARIANTS if machine in ("x86_64", "AMD64") else ()


def select_variant(
    flags: Iterable[str], machine: str, available: Iterable[str] | None = None
) -> CpuVariant | None:
    """The best variant for a CPU with these /proc/cpuinfo ``flags``: the first of
    ``variants_for(machine)`` whose flags it has (and, given ``available``, whose
    name is among them); None if none."""
    have = frozenset(flags)
    names = None if available is None else set(available)
    for variant in variants_for(machine):
        if variant.cpu_flags <= have and (names is None or variant.name in names):
            return variant
    return None


def variant_named(name: str, machine: str) -> CpuVariant:
    """The variant ``name`` of this architecture; ValueError naming the choices."""
    for variant in variants_for(machine):
        if variant.name == name:
            return variant
    choices = ", ".join(v.name for v in variants_for(machine))
    raise ValueError(f"unknown CPU variant {name!r} for {machine}; choose one of {choices}")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This CPU's feature flags (the first processor's ``flags`` line); empty
    where there is no /proc/cpuinfo."""
    if not cpuinfo.is_file():
        return frozenset()
    for line in cpuinfo.read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def host_variant() -> CpuVariant | None:
    """The best variant for the CPU this process runs on."""
    return select_variant(cpu_flags(), platform.machine())
