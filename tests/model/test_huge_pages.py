"""The KV cache's huge-page allocation: zeroed, writable, advised for 2 MB pages,
resident from the start, alive as long as any view of it, and plain
``torch.zeros`` where it cannot help."""

from __future__ import annotations

import gc
import mmap
import sys
from pathlib import Path

import pytest
import torch

from tokenloom.model import huge_pages
from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.model.kv_cache import allocate_kv_caches


def mapping_field(address: int, field: str) -> list[str]:
    """The smaps line ``field`` (``VmFlags``, ``Rss``) of this process's mapping
    that holds ``address``, less its name."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == f"{field}:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def mapping_flags(address: int) -> list[str]:
    return mapping_field(address, "VmFlags")


def test_zeros_are_zero_writable_and_the_requested_shape() -> None:
    t = huge_pages.zeros((3, 1024, 1024), torch.bfloat16, "cpu")
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    t[2, 1023, 1023] = 5.0
    assert t.sum().item() == 5.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="smaps is Linux's")
def test_large_tensors_are_advised_huge_pages() -> None:
    large = huge_pages.zeros((4 << 20,), torch.float32, "cpu")  # 16 MB
    assert "hg" in mapping_flags(large.data_ptr())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="smaps is Linux's")
def test_large_tensors_are_resident_before_their_first_write() -> None:
    # Faulted in at allocation, as torch.zeros would, not by the first steps that write them.
    large = huge_pages.zeros((4 << 20,), torch.float32, "cpu")  # 16 MB
    rss_kb, unit = mapping_field(large.data_ptr(), "Rss")
    assert unit == "kB" and int(rss_kb) >= 16 << 10


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="smaps is Linux's")
def test_background_population_makes_pages_resident_and_keeps_contents(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(huge_pages, "_populator", None)
    monkeypatch.setattr(huge_pages, "_pending", [])
    huge_pages.populate_in_background()
    tensors = [huge_pages.zeros((4 << 20,), torch.float32, "cpu") for _ in range(4)]  # 16 MB
    tensors[0][-1] = 7.0  # a write that may come before the thread reaches the page
    assert len(huge_pages._pending) == 4  # the thread's work, not the caller's
    huge_pages.wait_populated()
    assert not huge_pages._pending
    for t in tensors:
        rss_kb, unit = mapping_field(t.data_ptr(), "Rss")
        assert unit == "kB" and int(rss_kb) >= 16 << 10
    assert tensors[0].sum().item() == 7.0 and not tensors[1].any()
    assert huge_pages._populator is not None
    huge_pages._populator.shutdown()


def test_tensors_under_one_huge_page_are_left_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    # Not read off smaps: the heap a small malloc lands in may itself have been
    # advised by the allocator, so only "no mapping of our own" is this module's.
    def no_mapping(*args: object, **kwargs: object) -> None:
        raise AssertionError("a tensor under 2 MB got its own mapping")

    monkeypatch.setattr(mmap, "mmap", no_mapping)
    small = huge_pages.zeros((1024, 511), torch.float32, "cpu")  # 8 KB short of 2 MB
    assert small.shape == (1024, 511) and not small.any()


def test_the_memory_outlives_the_tensor_through_its_views() -> None:
    t = huge_pages.zeros((2, 2 << 20), torch.float32, "cpu")
    t.fill_(2.0)
    view = t[1]
    del t
    gc.collect()
    assert view.sum().item() == 2.0 * (2 << 20)


def test_other_devices_get_torch_zeros() -> None:
    t = huge_pages.zeros((4 << 20,), torch.float32, "meta")
    assert t.device.type == "meta" and t.shape == (4 << 20,)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="smaps is Linux's")
def test_cpu_kv_caches_sit_on_huge_pages() -> None:
    arch = ModelArchConfig(
        architecture="LlamaForCausalLM", hidden_size=576, intermediate_size=1536,
        num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        vocab_size=100, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=1e4,
        rope_scaling=None, tie_word_embeddings=True, attention_bias=False, bos_token_id=None,
    )  # fmt: skip
    caches = allocate_kv_caches(arch, 512, 16, torch.float32, "cpu")  # 6 MB a tensor
    for k, v in caches:
        assert "hg" in mapping_flags(k.data_ptr()) and "hg" in mapping_flags(v.data_ptr())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="smaps is Linux's")
def test_weight_arena_packs_small_tensors_side_by_side_on_huge_pages() -> None:
    arena = huge_pages.WeightArena()
    sources = [torch.randn(37, 11), torch.randn(300, 64).bfloat16(), torch.randn(5)]
    placed = [arena.place(t) for t in sources]
    for source, copy in zip(sources, placed, strict=True):
        assert copy.dtype == source.dtype and copy.is_contiguous() and torch.equal(copy, source)
        assert copy.data_ptr() != source.data_ptr() and copy.data_ptr() % 64 == 0
        assert "hg" in mapping_flags(copy.data_ptr())
    # One chunk, in placement order, each right after the previous (to a cache line).
    ends = [t.data_ptr() + t.numel() * t.element_size() for t in placed]
    for end, following in zip(ends, placed[1:], strict=False):
        assert 0 <= following.data_ptr() - end < 64
    assert mapping_field(placed[0].data_ptr(), "Size") == mapping_field(
        placed[2].data_ptr(), "Size"
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="smaps is Linux's")
def test_weight_arena_gives_a_tensor_larger_than_a_chunk_its_own_mapping() -> None:
    arena = huge_pages.WeightArena()
    small = arena.place(torch.ones(16))
    large = arena.place(torch.full((huge_pages.WeightArena.CHUNK_BYTES // 4 + 1,), 3.0))
    assert bool(large.eq(3.0).all())
    assert "hg" in mapping_flags(large.data_ptr())
    size_kb = int(mapping_field(large.data_ptr(), "Size")[0])
    assert size_kb * 1024 >= large.numel() * 4 and size_kb * 1024 % huge_pages.HUGE_PAGE_BYTES == 0
    assert small.sum().item() == 16.0  # the earlier chunk is untouched
    del arena
    gc.collect()
    assert small.sum().item() == 16.0 and large[-1].item() == 3.0  # alive through the tensors


def test_weight_arena_leaves_other_devices_and_empty_tensors_alone() -> None:
    arena = huge_pages.WeightArena()
    meta = torch.empty(4 << 20, device="meta")
    empty = torch.empty(0, 16)
    assert arena.place(meta) is meta and arena.place(empty) is empty
