"""Thread binding through the native CPU extension."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.torch_threads import intra_op_threads
from tokenloom.ops.cpu_kernels import bind_threads_to_cores


def _single_cpu_threads() -> set[int]:
    """CPUs that some thread of this process is confined to, alone."""
    pinned: set[int] = set()
    for status in Path("/proc/self/task").glob("*/status"):
        for line in status.read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                value = line.split(":", 1)[1].strip()
                if value.isdigit():
                    pinned.add(int(value))
    return pinned


def test_bind_threads_pins_workers_and_leaves_the_caller_free() -> None:
    allowed = os.sched_getaffinity(0)
    threads = min(torch.get_num_threads(), len(allowed))
    with intra_op_threads(threads):
        cpus = bind_threads_to_cores()
        assert cpus == sorted(allowed)[:threads]
        assert os.sched_getaffinity(0) == allowed  # the calling thread is not confined
        if threads > 1:
            assert set(cpus[1:]) <= _single_cpu_threads()
        # Work still runs (and agrees) on the pinned pool.
        a = torch.randn(256, 256)
        assert torch.allclose(a @ a, (a.double() @ a.double()).float(), atol=1e-3)
