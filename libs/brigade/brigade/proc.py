"""Child processes that must not outlive the service that started them (rq workers)."""

from __future__ import annotations

import signal


def die_with_parent() -> None:
    """preexec_fn for helper children (rq workers): the kernel SIGKILLs the child when its parent
    dies, even by SIGKILL, so a killed service leaves no orphan behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
