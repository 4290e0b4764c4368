"""DeepSpeed's native ops that grpo-dist uses on a CPU (the shared-memory collectives, CPU Adam), loaded safely.

DeepSpeed compiles these on first use and takes a lock file around every load, even when nothing needs compiling. A
process killed while it holds that file (a run stopped during start-up) leaves it behind, and every later load on
the machine waits on it forever. Here loads are serialised by an advisory lock that the kernel drops when its holder
dies; whoever holds it knows no other grpo-dist process is inside a build, so a lock file it finds is stale and
removed. `make install` runs this module once so that no run pays for the compile (minutes on two cores).

The ops are kept in the Python environment (`build_root`), not in the user's cache that every environment shares:
torch rebuilds an op whenever its build flags change, and two environments' flags differ (their include paths), so
two checkouts with a venv each rebuilt each other's ops turn about, minutes each time, mid-run.

Every load runs the ninja installed with DeepSpeed (pip's `ninja`), never whichever comes first on PATH: a machine
often has another (Debian's ninja-build 1.11 beside pip's 1.13), and the two keep build logs in formats each
discards from the other, so a process with the other one first on PATH recompiled the op from scratch, and the
next process with the first one compiled it again.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

COMM = "ShareMemCommBuilder"  # DeepSpeed's shared-memory collectives, which every rank loads on a CPU
CPU_ADAM = "CPUAdamBuilder"  # the optimizer step on the CPU, with learner.offload


def needed(offload: str, on_gpu: bool) -> list[str]:
    """The ops a learner rank loads: the collectives on a CPU, CPU Adam whenever the optimizer is offloaded."""
    return ([] if on_gpu else [COMM]) + ([CPU_ADAM] if offload != "none" else [])


def build_root() -> Path:
    """Where torch keeps compiled extensions: `TORCH_EXTENSIONS_DIR`, set here to `torch_extensions` in this Python
    environment (the venv) where it is not set, for this process and what it starts."""
    from torch.utils.cpp_extension import _get_build_directory

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))

    return Path(_get_build_directory("grpo_dist", verbose=False)).parent


def load(names: list[str], log=print) -> None:
    """Load (and on first use compile) the named DeepSpeed op builders, removing any lock file a killed load left."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    _pin_ninja()
    with _exclusive(build_root() / "grpo_dist" / "lock"):
        for name in names:
            builder = get_accelerator().create_op_builder(name)
            if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
                continue  # DeepSpeed does without it on this machine
            build_dir = build_root() / builder.name
            _remove_stale_lock(build_dir / "lock", log)
            compiled = (build_dir / f"{builder.name}.so").exists()
            if not compiled:
                log(f"compiling DeepSpeed's {builder.name} op into {build_dir} (once per machine, minutes on a CPU)")
            started = time.monotonic()
            builder.load(verbose=False)
            if not compiled:
                log(f"compiled {builder.name} in {time.monotonic() - started:.0f} s")


def _pin_ninja() -> None:
    """Put the directory of pip's `ninja` first on this process's PATH (torch runs `ninja` by name); nothing to do
    where it is not installed."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if not path.startswith(ninja.BIN_DIR + os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path])


@contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released by the kernel if this process dies
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_stale_lock(lock: Path, log) -> None:
    if lock.exists():
        log(f"removing {lock}, left by a DeepSpeed op load that was killed (it would make every load wait forever)")
        lock.unlink(missing_ok=True)


def main() -> None:
    load([COMM, CPU_ADAM], log=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"DeepSpeed CPU ops ready in {build_root()}")


if __name__ == "__main__":
    main()
