"""The native library this package carries: built, loaded for this CPU, every op
registered. A packaging defect (a source file or a variant left out of the
build) fails here rather than running the slow torch paths unnoticed."""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenloom.ops import native_library
from tokenloom.ops.cpu_kernels import layer_ops_available
from tokenloom.ops.cpu_variants import cpu_flags, host_variant, variant_named, variants_for
from tokenloom.quantization.kernels import native_available


def test_the_best_variant_for_this_cpu_is_built_and_loaded_with_every_op() -> None:
    best = host_variant()
    loaded = native_library.load_library()
    if not variants_for(platform.machine()):
        assert loaded is None and native_library.built_variants() == {}
        return
    assert best is not None, "this x86-64 CPU runs no variant (it lacks AVX2)"
    assert best.name in native_library.built_variants(), "the library for this CPU is not built"
    assert loaded == best
    assert native_library.missing_ops() == []
    assert native_available() and layer_ops_available(torch.device("cpu"), torch.float32)


def test_each_built_variant_this_cpu_runs_loads_when_forced() -> None:
    """Each in a process of its own: they register the same op names."""
    built = native_library.built_variants()
    assert built or not variants_for(platform.machine())
    script = "from tokenloom.ops import native_library as n\nprint(n.load_library().name, n.missing_ops())"
    for name in built:
        env = dict(os.environ, TOKENLOOM_CPU_VARIANT=name)
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
        )
        if variant_named(name, platform.machine()).cpu_flags <= cpu_flags():
            assert done.returncode == 0, done.stderr
            assert done.stdout.split() == [name, "[]"]
        else:
            assert f"TOKENLOOM_CPU_VARIANT={name}: this CPU lacks" in done.stderr


def test_without_a_built_library_it_warns_once_and_loads_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native_library, "LIBRARY_DIR", tmp_path)
    native_library.load_library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native_library.__name__):
            assert native_library.load_library() is None
            assert native_library.load_library() is None
        assert len(caplog.records) == 1
        assert "using torch paths" in caplog.records[0].getMessage()
    finally:
        native_library.load_library.cache_clear()
