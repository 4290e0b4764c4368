"""`grpo-dist submit` and `grpo-dist job` against a real Ray head started with token authentication on this
machine: a run submitted with the token is followed to success and its reward workers see a forwarded variable
(whose value is never printed); a submission without the token, or with a wrong one, is a one-line error."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import time
import uuid

import pytest
import yaml
from conftest import REPO, small_config
from ray_nodes import RAY, free_port, node_env, own_ports, stop_processes_under

pytestmark = pytest.mark.slow
SECRET = "GRPO_DIST_TEST_SECRET"


@pytest.fixture(scope="module")
def token_head(tmp_path_factory):
    """The job server's URL of a one-node Ray cluster with token auth (4 CPUs: a small run's actors)."""
    root = tmp_path_factory.mktemp("jobs")
    dashboard = free_port()
    head = [RAY, "start", "--head", f"--port={free_port()}", "--num-cpus=4", f"--temp-dir={root / 'head'}",
            f"--dashboard-port={dashboard}", "--include-dashboard=true", "--disable-usage-stats",
            *own_ports()]  # fmt: skip
    try:
        subprocess.run(head, check=True, env=node_env(), capture_output=True, timeout=180)
        yield f"http://127.0.0.1:{dashboard}"
    finally:
        stop_processes_under(root)


def grpo_dist(*args: str, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo_dist", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def test_a_submitted_run_is_followed_to_success_and_sees_a_forwarded_variable(token_head, tmp_path):
    secret = uuid.uuid4().hex
    work = tmp_path / "work"  # the job's files: its config only (grpo-dist and the fixtures are on the cluster)
    work.mkdir()
    raw = small_config(tmp_path, run={"output_dir": str(tmp_path / "outputs"), "steps": 2})
    digest = hashlib.sha256(secret.encode()).hexdigest()
    raw["reward"]["functions"] = [{"name": "reward_fixtures.env_reward", "kwargs": {"name": SECRET, "sha256": digest}}]
    (work / "run.yaml").write_text(yaml.safe_dump(raw))
    env = {**node_env(), SECRET: secret}
    result = grpo_dist("submit", str(work / "run.yaml"), "--address", token_head, "--env", SECRET,
                       "--working-dir", str(work), env=env)  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert f"forwarded: {SECRET} (values not shown)" in result.stdout
    assert "SUCCEEDED" in result.stdout and "run directory:" in result.stdout  # the job's own output, followed
    assert secret not in result.stdout + result.stderr
    rows = [json.loads(line) for line in (tmp_path / "outputs" / "test" / "metrics.jsonl").read_text().splitlines()]
    assert [row["reward/mean"] for row in rows] == [1.0, 1.0]  # every completion scored where the variable was set
    job_id = result.stdout.split("submitted ", 1)[1].split()[0]
    status = grpo_dist("job", "status", job_id, "--address", token_head, env=env, timeout=60)
    assert status.returncode == 0 and f"{job_id}: SUCCEEDED" in status.stdout


def test_job_stop_lets_the_run_write_its_checkpoint(token_head, tmp_path):
    """`grpo-dist job stop` is SIGTERM to the run; the wait Ray leaves before killing it (3 s by default) is raised,
    so the run writes a checkpoint of its last finished step and its policy before it exits."""
    raw = small_config(tmp_path, run={"output_dir": str(tmp_path / "outputs"), "steps": 10_000},
                       checkpoint={"every_steps": 100_000})  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    env = node_env()
    submitted = grpo_dist("submit", str(tmp_path / "run.yaml"), "--address", token_head, "--no-follow",
                          "--working-dir", str(tmp_path), env=env, timeout=120)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    job_id = submitted.stdout.split("submitted ", 1)[1].split()[0]
    metrics = tmp_path / "outputs" / "test" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 2:
        assert time.monotonic() < deadline, "the job logged no second step within 300 s"
        time.sleep(1)
    stopped = grpo_dist("job", "stop", job_id, "--address", token_head, env=env, timeout=60)
    assert stopped.returncode == 0 and "asked to stop" in stopped.stdout
    deadline = time.monotonic() + 300
    while "STOPPED" not in (status := grpo_dist("job", "status", job_id, "--address", token_head, env=env)).stdout:
        assert time.monotonic() < deadline, status.stdout
        time.sleep(2)
    logs = grpo_dist("job", "logs", job_id, "--address", token_head, env=env, timeout=60).stdout
    assert re.search(r"checkpoint of step \d+ written", logs), logs[-3000:]
    assert (tmp_path / "outputs" / "test" / "interrupted" / "model.safetensors").is_file()


@pytest.mark.parametrize("token", [None, "0" * 64], ids=["missing", "wrong"])
def test_a_submission_without_the_right_token_says_what_to_set(token_head, tmp_path, token):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(small_config(tmp_path, run={"output_dir": str(tmp_path / "outputs")})))
    env = {**node_env(), "HOME": str(tmp_path)}  # no ~/.ray/auth_token here
    env.pop("RAY_AUTH_TOKEN")
    if token:
        env["RAY_AUTH_TOKEN"] = token
    result = grpo_dist("submit", str(config), "--address", token_head, "--working-dir", str(tmp_path), env=env,
                       timeout=120)  # fmt: skip
    assert result.returncode == 2
    told = "missing" if token is None else "wrong"
    assert result.stderr.strip().splitlines() == [
        f"grpo-dist submit: the Ray job server at {token_head} uses token authentication and the token is {told}: "
        "set RAY_AUTH_TOKEN (or write ~/.ray/auth_token) to the cluster's token, the one its head was started with"
    ]


def test_a_relative_output_dir_is_refused_before_anything_is_sent(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(small_config(tmp_path, run={"output_dir": "outputs"})))
    result = grpo_dist("submit", str(config), "--address", "http://127.0.0.1:1", "--working-dir", str(tmp_path),
                       env=node_env(), timeout=60)  # fmt: skip
    assert result.returncode == 2
    assert "run.output_dir: 'outputs' is relative; a submitted run needs an absolute path" in result.stderr
