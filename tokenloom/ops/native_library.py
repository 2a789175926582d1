"""Loads the native CPU library: the best built variant this CPU runs.

``setup.py`` builds ``tokenloom/_C_<variant>.so`` for each variant of
``cpu_variants``; ``load_library()`` picks one once per process by the CPU's
flags, loads it with ``torch.ops.load_library`` (which registers the
``torch.ops.tokenloom_cpu`` and ``torch.ops.tokenloom_quant`` ops), and logs
which. Only one variant is ever loaded in a process: they register the same op
names.

- ``TOKENLOOM_CPU_KERNELS=0``: callers use their torch paths (same results,
  slower); checked by the callers on each use, so a test may switch it.
- ``TOKENLOOM_CPU_VARIANT=<name>``: load that variant instead of the best one
  (for debugging and tests); an error if it is not built or the CPU lacks its
  instructions.

Without a built library (a source checkout nobody built), or on a CPU no
variant runs on, it warns once and callers use their torch paths.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from collections.abc import Iterable
from pathlib import Path

import torch

from tokenloom.ops.cpu_variants import (
    CpuVariant,
    cpu_flags,
    select_variant,
    variant_named,
    variants_for,
)

logger = logging.getLogger(__name__)

# Where setup.py puts the libraries: the tokenloom package's own folder.
LIBRARY_DIR = Path(__file__).resolve().parents[1]
PREFIX = "_C_"


# What every variant registers (csrc/: TORCH_LIBRARY blocks): the ops and the
# classes the rest of tokenloom calls.
OPS = {
    "tokenloom_cpu": (
        "bind_threads",
        "bf16_dot_products",
        "paged_attention",
        "write_kv",
        "rms_norm",
        "add_rms_norm",
        "silu_and_mul",
        "rotary_qk",
        "dense_linear",
        "dense_linear_silu",
        "dense_bf16_dot_products",
        "panel_rows",
        "decoder_stack_steps",
    ),
    "tokenloom_quant": ("quant_linear", "quant_linear_silu"),
}
CLASSES = {
    "tokenloom_cpu": ("DecoderStack", "DenseProjection"),
    "tokenloom_quant": ("QuantProjection",),
}


def kernels_enabled() -> bool:
    return os.environ.get("TOKENLOOM_CPU_KERNELS", "1") != "0"


def built_variants(directory: Path = LIBRARY_DIR) -> dict[str, Path]:
    """The variants built into ``directory``: name -> library."""
    return {path.stem.removeprefix(PREFIX): path for path in directory.glob(f"{PREFIX}*.so")}


def choose_variant(
    built: Iterable[str], flags: Iterable[str], machine: str, forced: str | None = None
) -> CpuVariant | None:
    """The variant to load: ``forced`` (a TOKENLOOM_CPU_VARIANT value), or the best
    built one for a CPU with these flags; None if none is built or fits."""
    built = set(built)
    if not forced:
        return select_variant(flags, machine, built)
    try:
        variant = variant_named(forced, machine)
    except ValueError as e:
        raise ValueError(f"TOKENLOOM_CPU_VARIANT: {e}") from None
    if variant.name not in built:
        raise ValueError(
            f"TOKENLOOM_CPU_VARIANT={forced}: that variant is not built "
            f"(built: {', '.join(sorted(built)) or 'none'})"
        )
    missing = variant.cpu_flags - set(flags)
    if missing:
        raise ValueError(
            f"TOKENLOOM_CPU_VARIANT={forced}: this CPU lacks {', '.join(sorted(missing))}"
        )
    return variant


@functools.cache
def load_library() -> CpuVariant | None:
    """Load the chosen variant once per process; None (after one warning) where
    there is none, and callers run their torch paths."""
    machine = platform.machine()
    built = built_variants(LIBRARY_DIR)
    variant = choose_variant(
        built, cpu_flags(), machine, os.environ.get("TOKENLOOM_CPU_VARIANT") or None
    )
    if variant is None:
        if not variants_for(machine):
            why = "the kernels have no code for this architecture"
        elif built:
            why = "none of the built variants runs on this CPU"
        else:
            why = f"none is built in {LIBRARY_DIR} (`make setup` or `pip install .` builds it)"
        logger.warning("native CPU kernels unavailable for %s: %s; using torch paths", machine, why)
        return None
    torch.ops.load_library(str(built[variant.name]))
    logger.info("native CPU kernels: %s (%s)", variant.name, built[variant.name].name)
    return variant


def missing_ops() -> list[str]:
    """Of ``OPS`` and ``CLASSES``, those this process has not registered."""
    missing = []
    for namespace, names in OPS.items():
        for name in names:
            if not torch._C._dispatch_has_kernel(f"{namespace}::{name}"):
                missing.append(f"{namespace}::{name}")
    for namespace, names in CLASSES.items():
        for name in names:
            try:
                getattr(getattr(torch.classes, namespace), name)
            except RuntimeError:
                missing.append(f"{namespace}::{name}")
    return missing
