"""The glibc allocator tuning the CPU runner applies at start."""

from __future__ import annotations

import platform

import pytest

from tokenloom.worker.host_malloc import keep_freed_memory, release_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning applies to glibc only")
def test_keep_freed_memory_applies_on_glibc() -> None:
    assert keep_freed_memory() is True


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_release_freed_memory_trims_on_glibc() -> None:
    assert release_freed_memory() is True
