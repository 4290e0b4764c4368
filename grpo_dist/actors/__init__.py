"""The run's actors: learner ranks, generators and reward workers, one engine each."""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Have the kernel kill this process when its parent (the Ray node's raylet) exits. Ray stops its workers by
    asking them to exit; one stuck in C code cannot hear it and would outlive the run, even the cluster."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
