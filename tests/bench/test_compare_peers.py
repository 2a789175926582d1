"""Pieces of benchmarks/compare_peers.py that need no engine: FLOP counting, result checks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tokenloom.bench.datasets import BenchRequest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "compare_peers.py"
_spec = importlib.util.spec_from_file_location("compare_peers", _PATH)
assert _spec is not None and _spec.loader is not None
cp = importlib.util.module_from_spec(_spec)
sys.modules["compare_peers"] = cp  # dataclasses look their module up
_spec.loader.exec_module(cp)

TINY = {
    "hidden_size": 4,
    "intermediate_size": 8,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 2,
    "vocab_size": 10,
}


def test_model_flops_by_hand():
    # per layer: q,o 4x4 each, k,v 4x2 each, mlp 3x4x8 = 144 params; lm_head 40.
    req = BenchRequest([5, 6, 7], max_tokens=2)
    # fed tokens 3 + 2 - 1 = 4 -> 2*144*4; lm_head 2*40*2; attention 4*2*2*(1+2+3+4)
    assert cp.model_flops(TINY, [req]) == 1152 + 160 + 160
    # The second request's first 2 prompt tokens come from the prefix cache:
    # fed 2 -> 2*144*2; lm_head 160; attention contexts 3 and 4 -> 4*4*7.
    assert cp.model_flops(TINY, [req, req], prefix_cached=2) == 1472 + 576 + 160 + 112


def test_collect_verifies_lengths_and_medians():
    reqs = {"w": [BenchRequest([1, 2], 3), BenchRequest([3], 2)]}
    run = {"output_tokens": [3, 2], "cached_tokens": 0, "own_cpu_s": 1.0, "busy_wait_s": 0}
    data = {
        "runs": {
            "w": [
                {**run, "wall_s": 3.0, "other_cpu_s": 0.0},
                {**run, "wall_s": 1.0, "other_cpu_s": 1.0},
                {**run, "wall_s": 2.0, "other_cpu_s": 0.0, "output_tokens": [3, 1]},
            ]
        }
    }
    res = cp.collect(data, "x", reqs, ncpu=2)["w"]
    assert res.wall == 2.0
    assert not res.lengths_ok  # the third run returned a short request
    assert res.other_cpu_frac == pytest.approx(0.5)  # 1 cpu-s over 1 s on 2 cores
