"""Pieces of benchmarks/peers/compare_peers.py that need no engine: FLOP counting, result checks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tokenloom.bench.datasets import BenchRequest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "peers" / "compare_peers.py"
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


def test_write_report_table_and_chart(tmp_path):
    import argparse

    workloads = {
        "main": [BenchRequest([1] * 10, 5), BenchRequest([2] * 20, 5)],
        "shared-prefix": [BenchRequest([3] * 8, 4)],
    }
    res = {
        ("tokenloom", "main"): cp.EngineResult("tokenloom", "main", walls=[2.0, 1.0, 3.0]),
        ("vllm", "main"): cp.EngineResult("vllm", "main", walls=[1.0], other_cpu_frac=0.5),
        ("tokenloom", "shared-prefix"): cp.EngineResult(
            "tokenloom", "shared-prefix", walls=[1.0], cached_tokens=4
        ),
    }
    args = argparse.Namespace(
        out_md=tmp_path / "peers.md",
        out_png=tmp_path / "peers.png",
        ceiling_n=64,
        seed=0,
        main_requests=7,
        hf_batch_sizes="8",
        idle_wait=1.0,
        note="noisy",
        gguf="model.gguf",
        hf_model=Path("exports/smollm2-hf-bf16"),
        tokenloom_model=None,
        tokenloom_dtype="auto",
        kv_cache_dtype="auto",
        vllm_dtype="bfloat16",
        repeats=3,
        rounds=2,
    )
    floors = {"main": (1.0, 1.0), "shared-prefix": (2.0, 1.5)}
    cp.write_report(args, res, workloads, {"float32": 10.0, "bfloat16": 5.0}, floors, "cmd x")
    text = (tmp_path / "peers.md").read_text()
    # main: 10 output tokens, 40 total, median wall 2.0 s -> 5.0 and 20.0 tok/s
    assert "| tokenloom | main | 5.0 | 20.0 | 2.00 | 1.00x | 0% | ok | 3 | 0% | 0 |" in text
    # vllm: wall 1.0 -> ratio 2.00x, busy warning
    assert "| vllm | main | 10.0 | 40.0 | 1.00 | 2.00x |" in text
    assert "vllm / main: other processes used up to 50%" in text
    assert '"main": 7 requests' in text
    assert "| tokenloom | shared-prefix | 4.0 | 12.0 | 1.00 | 1.00x | 50% |" in text
    assert "cmd x" in text and "Note: noisy" in text
    assert "directory `smollm2-hf-bf16`\n  (vLLM in bfloat16)" in text
    assert "tokenloom reads `model.gguf`" in text and "the GGUF\n  `model.gguf`'s" in text
    assert "Median of the runs (2 rounds of 3, each engine's place in the order reversed" in text
    assert (tmp_path / "peers.png").read_bytes()[:4] == b"\x89PNG"


def test_engine_labels_name_the_llamacpp_slots():
    assert cp.engine_label("llamacpp") == "llama.cpp"
    assert cp.engine_label("llamacpp-np16") == "llama.cpp -np 16"
    assert cp.engine_label("vllm") == "vllm"


def test_rounds_alternate_the_order_and_pool_the_runs():
    jobs = ["tokenloom", "vllm", "llamacpp"]
    assert cp.round_order(jobs, 0) == jobs
    assert cp.round_order(jobs, 1) == ["llamacpp", "vllm", "tokenloom"]
    assert cp.round_order(jobs, 2) == jobs

    def result(walls, decode_ms, own, rss):
        return {
            "runs": {"main": [{"wall_s": w} for w in walls]},
            "single": [{"decode_ms_per_token": d} for d in decode_ms],
            "config": {"dtype": "auto", "own_decode_ms_per_token": own},
            "rss_mb": rss,
            "load_s": 1.0,
        }

    first, second = result([3.0, 4.0], [9.0], [8.0], 100), result([1.0], [7.0, 6.0], [5.0], 300)
    merged = cp.merge_rounds([first, second])
    assert [r["wall_s"] for r in merged["runs"]["main"]] == [3.0, 4.0, 1.0]
    assert [r["decode_ms_per_token"] for r in merged["single"]] == [9.0, 7.0, 6.0]
    assert merged["config"] == {"dtype": "auto", "own_decode_ms_per_token": [8.0, 5.0], "rounds": 2}
    assert merged["rss_mb"] == 300
    assert first["runs"]["main"] == [
        {"wall_s": 3.0},
        {"wall_s": 4.0},
    ]  # the inputs stay as they were
    assert cp.merge_rounds([first]) is first
