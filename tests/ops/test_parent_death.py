"""`own_group_dying_with_parent`: a child started with it is its own process group's leader and
gets SIGTERM when its parent is SIGKILLed (no `finally:` runs there); a plain child outlives it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

_PARENT = """
import subprocess, sys, time
from ops.parent_death import own_group_dying_with_parent
kw = {{"preexec_fn": own_group_dying_with_parent}} if {guarded} else {{}}
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], **kw)
print(child.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (dead, not yet reaped by init) counts as gone
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _child_of_killed_parent(guarded: bool) -> tuple[int, int]:
    """(child pid, its process group) after its parent was SIGKILLed."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT.format(guarded=guarded)], stdout=subprocess.PIPE,
                              text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    pgid = os.getpgid(pid)
    parent.kill()
    parent.wait()
    return pid, pgid


@pytest.mark.parametrize("guarded", [True, False])
def test_a_guarded_child_dies_with_its_killed_parent_and_a_plain_one_does_not(guarded: bool) -> None:
    pid, pgid = _child_of_killed_parent(guarded)
    try:
        assert (pgid == pid) is guarded  # its own group: a terminal's Ctrl-C reaches only the parent
        deadline = time.monotonic() + (10 if guarded else 1.5)
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if guarded:
            assert not _alive(pid), "the guarded child outlived its parent"
        else:
            assert _alive(pid)  # what the guard is for: nothing else stops it
    finally:
        if _alive(pid):
            os.kill(pid, 9)
