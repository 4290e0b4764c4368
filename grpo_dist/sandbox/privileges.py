"""What a process may do, set on itself: the user it runs as, its capabilities, whether it may gain privileges, be
read or traced by its own user, and whether it dies with its parent. The jail (`grpo_dist.sandbox.jail`), the sandboxes
(`grpo_dist.sandbox`) and the actors use these."""

from __future__ import annotations

import ctypes
import os
import platform
import signal
import sys

NOBODY = 65534
KEYCTL_JOIN_SESSION_KEYRING = 1
KEYCTL_SYSCALL = {"x86_64": 250, "aarch64": 219}  # keyctl(2) by machine
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_KEEPCAPS = 8
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
CAP_DAC_READ_SEARCH = 2
CAPABILITY_VERSION_3 = 0x20080522


def hide_from_own_user() -> None:
    """Make this process undumpable: a process of its user without privileges can then neither read its memory nor
    its environment (`/proc/<pid>/environ`: the run's tokens) nor trace it. For code run as this process's own user
    (best effort, not as root)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def own_keyring() -> None:
    """A session keyring of its own: the kernel's keyrings are not namespaced, and the caller's would be shared."""
    number = KEYCTL_SYSCALL.get(platform.machine())
    if number is not None:
        ctypes.CDLL(None, use_errno=True).syscall(number, KEYCTL_JOIN_SESSION_KEYRING, None)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def become_nobody() -> None:
    """As root, become `nobody` (whom a process limit binds; the kernel never applies one to root), keeping one
    capability where it holds it, reading files, until its next `exec` (so an interpreter installed where only root
    may read stays importable). `OSError` where the machine refuses the change of user."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0)
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    read = 1 << CAP_DAC_READ_SEARCH
    if libc.capset(ctypes.byref(_CapHeader(CAPABILITY_VERSION_3, 0)), (_CapData * 2)(_CapData(read, read, 0))):
        libc.capset(ctypes.byref(_CapHeader(CAPABILITY_VERSION_3, 0)), (_CapData * 2)())  # none at all


def no_privileges() -> None:
    """Drop every capability this process holds (a sandbox's call, forked from a server as `nobody` that may keep
    one), and never gain one again: no new privileges through `exec` either. `OSError` where refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.capset(ctypes.byref(_CapHeader(CAPABILITY_VERSION_3, 0)), (_CapData * 2)()) != 0:
        raise OSError(ctypes.get_errno(), "capset refused")
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS refused")


def as_nobody() -> None:
    """Best effort without namespaces, as root: a keyring of its own, `nobody`, and death with the process that
    started it (a change of user clears that)."""
    own_keyring()
    become_nobody()
    die_with_parent()


def die_with_parent() -> None:
    """Have the kernel kill this process when its parent exits (a Ray worker's: the node's raylet). Ray stops its
    workers by asking them to exit; one stuck in C code cannot hear it and would outlive the run, even the cluster.
    A change of user clears it."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def reap_orphans_here(on: bool = True) -> None:
    """Make this process the subreaper of its descendants (`on`) or stop it: a process they leave behind when their
    parent ends is re-parented here, not to the machine's init, so this process can reap it."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on))
