"""The scheduler is pure Python: importing it must not pull in torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_scheduler_import_does_not_load_torch() -> None:
    code = (
        "import sys, tokenloom.core.sched, tokenloom.core.sched.scheduler\n"
        "sys.exit(1 if 'torch' in sys.modules else 0)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo)
    assert result.returncode == 0, result.stderr or "torch was imported"
