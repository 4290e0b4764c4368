"""Losing the whole cluster: a submitted run's head node and worker node (every Ray process, the job's driver and
every actor with them) killed at once mid-run, the cluster started again, the job submitted again as it was (submit
adds `--resume auto`). The run goes on from its latest checkpoint in the shared output directory and finishes with
every step logged once, in the same W&B run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, small_config
from ray_nodes import RAY, free_port, node_env, node_root, own_ports, stop_processes_under
from wandb_files import history

pytestmark = pytest.mark.slow

STEPS = 12


def start_cluster(root: Path) -> str:
    """A head node (the job server and the driver; no CPUs for actors) and a worker node with room for a small run
    (learner rank, generator, two reward workers), each with a temp dir of its own; returns the job server's URL."""
    port, dashboard = free_port(), free_port()
    head = [RAY, "start", "--head", f"--port={port}", "--num-cpus=0", f"--temp-dir={root / 'head'}",
            f"--dashboard-port={dashboard}", "--include-dashboard=true", "--disable-usage-stats",
            *own_ports()]  # fmt: skip
    worker = [RAY, "start", f"--address=127.0.0.1:{port}", "--num-cpus=4", f"--temp-dir={root / 'worker'}",
              "--disable-usage-stats", *own_ports()]  # fmt: skip
    for command in (head, worker):
        subprocess.run(command, check=True, env=node_env(), capture_output=True, timeout=180)
    return f"http://127.0.0.1:{dashboard}"


def submit(config: Path, address: str, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "grpo_dist", "submit", str(config), "--address", address,
               "--working-dir", str(config.parent), *flags]  # fmt: skip
    return subprocess.run(command, cwd=REPO, env=node_env(), capture_output=True, text=True, timeout=900)


def logged_steps(run_dir: Path) -> list[int]:
    try:
        return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or a line being written
        return []


def test_a_run_whose_whole_cluster_was_lost_finishes_every_step_once_when_submitted_again(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    raw = small_config(
        tmp_path,
        run={"output_dir": str(tmp_path / "outputs"), "steps": STEPS},
        checkpoint={"every_steps": 2, "keep": 2},
        wandb={"enabled": True, "mode": "offline"},
    )
    # A step of at least 0.4 s (16 completions, 2 workers): the cluster is lost mid-run, not after its end.
    raw["reward"]["functions"].append(
        {"name": "reward_fixtures.slow_reward", "weight": 0.0, "kwargs": {"delay_s": 0.05}}
    )
    config = work / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "outputs" / "test"

    first = node_root("loss-first")
    try:
        address = start_cluster(first)
        submitted = submit(config, address, "--no-follow")
        assert submitted.returncode == 0, (submitted.stdout + submitted.stderr)[-3000:]
        deadline = time.monotonic() + 600
        while not (run_dir / "checkpoints" / "step-000004").is_dir() or len(logged_steps(run_dir)) < 5:
            assert time.monotonic() < deadline, f"the first run logged {logged_steps(run_dir)} in 600 s"
            time.sleep(0.2)
    finally:
        stop_processes_under(first)  # every process of both nodes at once: the head, the worker, the job's driver
        shutil.rmtree(first, ignore_errors=True)
    lost_at = logged_steps(run_dir)[-1]
    print(f"the whole cluster was killed after step {lost_at}")
    assert lost_at < STEPS

    second = node_root("loss-second")
    try:
        again = submit(config, start_cluster(second))  # followed to its end
    finally:
        stop_processes_under(second)
        shutil.rmtree(second, ignore_errors=True)
    said = again.stdout + again.stderr
    assert again.returncode == 0, said[-4000:]
    resumed = int(said.split("resumed from ")[1].split(" after step ")[1].split()[0])
    assert 4 <= resumed <= lost_at, said[-3000:]
    assert logged_steps(run_dir) == list(range(1, STEPS + 1))
    assert (run_dir / "final" / "model.safetensors").is_file()
    # W&B: one run, its second session continuing from the checkpoint's step.
    sessions = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(sessions) == 2 and len({session.name.rsplit("-", 1)[1] for session in sessions}) == 1, sessions
    continued = [row["train/step"] for row in history(sessions[1]) if "train/step" in row and "reward/mean" in row]
    assert continued == list(range(resumed + 1, STEPS + 1))
