"""MPClient start-up failures are reported, not hung on."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenloom.config import CacheConfig, ModelConfig, SchedulerConfig
from tokenloom.engine.core_client import MPClient


@pytest.mark.timeout(180)
def test_startup_error_is_raised_and_process_reaped(tmp_path: Path) -> None:
    junk = tmp_path / "broken.gguf"
    junk.write_bytes(b"not a gguf file")
    client = MPClient(ModelConfig(model=str(junk)), CacheConfig(num_blocks=8), SchedulerConfig())
    with pytest.raises(RuntimeError, match="engine core failed to start"):
        client.wait_until_ready(timeout_s=150)
    client.proc.join(timeout=10)
    assert not client.proc.is_alive()
