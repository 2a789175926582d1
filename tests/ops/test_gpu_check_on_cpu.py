"""The GPU check's correctness section (``benchmarks/gpu/check.py``) on the CPU:
the CUDA backend's Triton attention and layer ops, run by the engine in Triton's interpreter,
against transformers, over a batch that takes chunked prefill, prefix hits and
preemption. GPU time is rare: the script must not fail there for a reason the
CPU could have shown."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_correctness_section_runs_the_triton_path(
    default_hf_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENLOOM_FORWARD_PLAN", "attention=triton,layer_ops=triton")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "gpu"))
    sys.modules.pop("check", None)
    import check

    check.main(
        [
            "correctness",
            "--out",
            str(tmp_path),
            "--device",
            "cpu",
            "--small",
            "--tokenizer",
            str(default_hf_model_dir),
        ]
    )
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {(r["model"], r["dtype"]) for r in records} == {
        (family, dtype) for family in ("llama", "qwen3") for dtype in ("float32", "bfloat16")
    }
    for record in records:
        assert "layer_ops=triton" in record["plan"] and "attention=triton" in record["plan"], record
        assert record["ok"], record
        assert record["preemptions"] > 0 and record["cached_tokens"] > 0, record


def _run_check(section: str, out: Path, tokenizer: Path, *extra: str) -> list[dict]:
    sys.modules.pop("check", None)
    import check

    check.main(
        [section, "--out", str(out), "--device", "cpu", "--small", "--tokenizer", str(tokenizer)]
        + list(extra)
    )
    lines = (out / "results.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.e2e
def test_kernels_section_compares_flex_attention(
    default_hf_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Triton (interpreted), the torch path and FlexAttention attend the same
    batches alike, and each is timed; so are the layer ops, Triton and torch."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "gpu"))
    records = _run_check("kernels", tmp_path, default_hf_model_dir)
    attention = [r for r in records if r["section"] == "kernels"]
    assert [r["case"] for r in attention] == ["decode 4 x 40", "mixed"]
    for record in attention:
        assert record["max_abs_diff"] < 0.05 and record["flex_max_abs_diff"] < 0.05, record
        assert min(record["triton_ms"], record["torch_ms"], record["flex_ms"]) > 0, record
    layer_ops = [r for r in records if r["section"] == "layer_ops"]
    assert [r["tokens"] for r in layer_ops] == [1, 3]
    for record in layer_ops:
        ops = {"add_rms_norm", "rotary_qk", "silu_and_mul"}
        assert set(record["triton_ms"]) == set(record["torch_ms"]) == ops, record
        assert min(record["triton_layer_ms"], record["torch_layer_ms"]) > 0, record


@pytest.mark.e2e
def test_decode_section_records_host_phases(
    default_hf_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Graphs (none on the CPU: the plan runs eagerly) with and without async
    scheduling, and eager with it; each with the host's phases per step."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "gpu"))
    records = _run_check("decode", tmp_path, default_hf_model_dir, "--shapes", "llama-3.2-1b")
    runs = {(r["graphs"], r["async_scheduling"]) for r in records}
    assert runs == {(True, True), (True, False), (False, True)}
    for record in records:
        phases = record["host_phases_ms"]
        assert record["ms_per_token"] > 0 and phases["steps"] >= 8, record
        for name in ("schedule", "launch", "wait", "update", "outputs"):
            assert phases[name] > 0, (name, record)
        # Phases never overlap but where nested (a synchronous runner waits
        # inside its launch): what is left of the wall time cannot be negative.
        assert phases["other"] >= 0, record
        if not record["async_scheduling"]:
            assert phases["wait"] < phases["launch"], record
