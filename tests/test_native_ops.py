"""DeepSpeed's CPU ops load even when a killed load left its lock file behind (which made every later load wait
forever: the learner ranks then hung in setup)."""

import os
import shutil
import subprocess
import sys

from grpo_dist.algo import native_ops


def test_a_lock_left_by_a_killed_load_does_not_hang_the_next_one(tmp_path):
    built = native_ops.build_root() / "deepspeed_shm_comm"
    assert (built / "deepspeed_shm_comm.so").exists(), "make install compiles the op; run it first"
    shutil.copytree(built, tmp_path / "deepspeed_shm_comm")  # keeps mtimes: nothing to recompile
    stale = tmp_path / "deepspeed_shm_comm" / "lock"
    stale.touch()  # what a process killed inside torch's build lock leaves
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    code = "from grpo_dist.algo import native_ops; native_ops.load([native_ops.COMM])"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "left by a DeepSpeed op load that was killed" in done.stdout
    assert not stale.exists()
    assert "compiling" not in done.stdout  # the copy was used as built


def test_the_ops_a_rank_needs():
    assert native_ops.needed("none", on_gpu=False) == [native_ops.COMM]
    assert native_ops.needed("optimizer", on_gpu=False) == [native_ops.COMM, native_ops.CPU_ADAM]
    assert native_ops.needed("optimizer_and_params", on_gpu=True) == [native_ops.CPU_ADAM]
    assert native_ops.needed("none", on_gpu=True) == []


def test_a_load_with_another_ninja_first_on_path_does_not_recompile(tmp_path):
    """Debian's ninja 1.11 first on PATH, pip's 1.13 beside DeepSpeed: each discards the other's build log, so
    whichever ran the load recompiled the op (a minute and both cores, each time a process of the other kind came)."""
    built = native_ops.build_root() / "deepspeed_shm_comm"
    assert (built / "deepspeed_shm_comm.so").exists(), "make install compiles the op; run it first"
    shutil.copytree(built, tmp_path / "deepspeed_shm_comm")
    so, log = tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so", tmp_path / "deepspeed_shm_comm" / ".ninja_log"
    before = (so.stat().st_mtime_ns, log.read_text())
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "PATH": "/usr/local/bin:/usr/bin:/bin"}
    code = "from grpo_dist.algo import native_ops; native_ops.load([native_ops.COMM])"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert (so.stat().st_mtime_ns, log.read_text()) == before  # nothing rebuilt, nothing relinked
