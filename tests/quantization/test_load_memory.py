"""What loading a quantized GGUF leaves in memory: the reader's map of the file is
gone, no float copy of a quantized matrix survives, and (in a fresh process, the
model runner's own load) the resident memory that stays is the quantized weights
plus the KV cache, not the file's pages or the load's freed temporaries."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from tests.quantization.blocks import LlamaShape, random_gguf, write_tiny_gguf
from tokenloom.config import CacheConfig, ModelConfig, SchedulerConfig
from tokenloom.engine.core import EngineCore
from tokenloom.model.gguf_loader import GGUFTensor
from tokenloom.model.kv_cache import kv_cache_bytes_per_block
from tokenloom.model_loader.loader import load_model
from tokenloom.quantization import loading
from tokenloom.quantization.formats import from_gguf
from tokenloom.quantization.linear import QuantLinear
from tokenloom.worker.model_runner import ModelRunner

ROOT = Path(__file__).resolve().parents[2]
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# Q4_K_M's mix: 4-bit matrices, a Q6_K V and down projection and embedding.
Q4_K_M = {**dict.fromkeys(MATRICES, T.Q4_K), "attn_v": T.Q6_K, "ffn_down": T.Q6_K}
Q4_K_M["token_embd"] = T.Q6_K


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_K, T.Q6_K, T.Q8_0])
def test_repacking_in_row_slices_matches_the_whole_matrix(
    qtype: T, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows, cols = 37, 512  # 3 rows per slice: 13 slices, the last one short
    raw = random_gguf(qtype, rows, cols, seed=3)
    monkeypatch.setattr(loading, "_SLICE_WEIGHTS", 3 * cols)
    sliced = loading._repack(GGUFTensor(raw, qtype, (rows, cols), None))
    whole = from_gguf(raw, qtype, (rows, cols))
    assert (sliced.bits, sliced.group, sliced.in_features) == (whole.bits, whole.group, cols)
    assert (sliced.mins is None) == (whole.mins is None)
    assert sliced.scales.form() == whole.scales.form()
    sliced_tensors, whole_tensors = sliced.tensors(), whole.tensors()
    assert len(sliced_tensors) == len(whole_tensors)  # Q4_0's shared base stays shared
    for got, expected in zip(sliced_tensors, whole_tensors, strict=True):
        assert got.dtype == expected.dtype
        assert torch.equal(got, expected)


def _mapped(path: Path) -> bool:
    return str(path.resolve()) in Path("/proc/self/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_loading_unmaps_the_file_and_keeps_no_float_matrix(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, Q4_K_M)
    loaded = load_model(ModelConfig(model=str(path), max_model_len=64))
    gc.collect()
    assert not _mapped(path), "the GGUF file is still mapped after loading"
    quantized = {id(m.qweight): m.qweight for m in loaded.model.modules() if hasattr(m, "qweight")}
    assert any(isinstance(m, QuantLinear) for m in loaded.model.modules())
    matrix_shapes = {(w.out_features, w.in_features) for w in quantized.values()}
    floats = [
        o
        for o in gc.get_objects()
        if type(o) in (torch.Tensor, torch.nn.Parameter) and o.is_floating_point() and o.dim() == 2
    ]
    survivors = [tuple(t.shape) for t in floats if tuple(t.shape) in matrix_shapes]
    assert not survivors, f"float copies of quantized matrices survive: {survivors}"
    # The RoPE table is sized for the served context, not the model's 8192 positions.
    assert loaded.model.rotary.cos_cache.shape[0] == 64


# Big enough that the file's pages or the load's temporaries would show: ~105 MB.
# (Before the reader released its map and the runner trimmed the heap, 340 MB
# beyond the weights stayed resident; now ~50 MB.)
RUNTIME_BYTES = 48 << 20  # the native kernels' libraries, allocator slack
MEDIUM = LlamaShape(hidden=1024, ffn=4096, layers=8, heads=8, kv_heads=2, vocab=32768)

_CHILD = """
import json, sys
import torch
from tokenloom.config import CacheConfig, ModelConfig, SchedulerConfig
from tokenloom.engine.core import EngineCore
from tokenloom.quantization.linear import quantized_weight_bytes
from tokenloom.worker.model_runner import ModelRunner

def rss():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}

torch.set_num_threads(1)
before = rss()
runner = ModelRunner(
    ModelConfig(model=sys.argv[1], max_model_len=256),
    CacheConfig(num_blocks=16),
    SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
)
after = rss()
kv = sum(t.numel() * t.element_size() for pair in runner.kv_caches for t in pair)
print(json.dumps({
    "before": before["VmRSS"], "after": after["VmRSS"], "peak": after["VmHWM"],
    "weights": quantized_weight_bytes(runner.model), "kv": kv,
}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_model_runner_keeps_only_weights_and_kv_resident(tmp_path: Path) -> None:
    path = tmp_path / "medium.gguf"
    write_tiny_gguf(path, Q4_K_M, shape=MEDIUM)
    file_bytes = path.stat().st_size
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    kept = got["after"] - got["before"]
    # The quantized weights are ~1.5x the file (fp32 scales); the file's pages
    # (another 1x) or the freed temporaries must not be counted on top, beyond the
    # libraries and allocator state loading brings in.
    assert got["weights"] > file_bytes
    limit = got["weights"] + got["kv"] + RUNTIME_BYTES + file_bytes // 4
    assert kept <= limit, (
        f"{kept / 1e6:.0f} MB stayed resident after loading; weights "
        f"{got['weights'] / 1e6:.0f} MB + KV {got['kv'] / 1e6:.0f} MB + runtime "
        f"{RUNTIME_BYTES / 1e6:.0f} MB + a quarter of the {file_bytes / 1e6:.0f} MB file allowed"
    )
    # While loading: one tensor's pages and temporaries at a time, not the whole file.
    peak = got["peak"] - got["before"]
    assert peak <= got["weights"] + got["kv"] + RUNTIME_BYTES + file_bytes, (
        f"peak {peak / 1e6:.0f} MB above the start while loading"
    )


def test_kv_cache_sized_in_bytes(tmp_path: Path) -> None:
    """``kv_cache_memory_bytes`` sizes the cache whatever the machine has free."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, Q4_K_M)
    budget = 3 << 20
    model_config = ModelConfig(model=str(path), max_model_len=4096)
    scheduler_config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256)
    core = EngineCore.from_config(
        model_config, CacheConfig(block_size=16, memory_bytes=budget), scheduler_config
    )
    try:
        runner = core.runner
        assert isinstance(runner, ModelRunner)
        per_block = kv_cache_bytes_per_block(runner.arch, 16, runner.kv_cache_dtype)
        assert core.num_blocks == runner.num_blocks == budget // per_block
        used = sum(t.numel() * t.element_size() for pair in runner.kv_caches for t in pair)
        assert budget - per_block < used <= budget
    finally:
        core.shutdown()
    with pytest.raises(ValueError, match="memory_bytes=1024 holds 0 blocks"):
        ModelRunner(
            ModelConfig(model=str(path), max_model_len=64),
            CacheConfig(block_size=16, memory_bytes=1024),
            scheduler_config,
        )
