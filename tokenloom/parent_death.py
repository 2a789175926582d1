"""Child processes that must not outlive their parent, SIGKILL of the parent included."""

from __future__ import annotations

import signal
import sys


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (elsewhere: nothing).

    Linux sends the signal when the *thread* that started this process exits,
    so a parent must start such children from a thread that lives as long as
    they should.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        pass
