"""Children that do not outlive the process that started them.

A benchmark or `edgeserve up` that is killed (SIGKILL, an OOM kill, a CI timeout) runs no
`finally:` and so stops none of its children; left alone they keep their ports, memory and
cores. `own_group_dying_with_parent`, passed as `preexec_fn`, runs in the child between fork
and exec: it puts the child in a process group of its own (a terminal's Ctrl-C then reaches
only the parent, which stops its children in order) and asks Linux to send the child SIGTERM
when the thread that forked it dies (`prctl(PR_SET_PDEATHSIG)`). The child's own SIGTERM
handling (a worker's drain, `up`'s shutdown of its services) then runs as on a plain stop.
"""

from __future__ import annotations

import ctypes
import os
import signal

__all__ = ["own_group_dying_with_parent"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def own_group_dying_with_parent() -> None:
    """In the child before exec: its own process group, and SIGTERM when its parent dies."""
    os.setpgid(0, 0)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
