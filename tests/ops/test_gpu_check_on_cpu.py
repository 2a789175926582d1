"""The GPU check's correctness section (``benchmarks/gpu/check.py``) on the CPU:
the CUDA backend's Triton attention, run by the engine in Triton's interpreter,
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
    monkeypatch.setenv("TOKENLOOM_FORWARD_PLAN", "attention=triton")
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
        assert "attention=triton" in record["plan"], record["plan"]
        assert record["ok"], record
        assert record["preemptions"] > 0 and record["cached_tokens"] > 0, record
