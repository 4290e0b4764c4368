"""`grpo-dist submit` and `grpo-dist job` against a real Ray head started with token authentication on this
machine: a run submitted with the token is followed to success and its reward workers see a forwarded variable
(whose value is never printed); a submission without the token, or with a wrong one, is a one-line error. And what a
submission sends (its job server stood in for): secrets only with `--forward-secrets`, which warns that Ray logs them;
without it, the secrets set here are named as not forwarded."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
import uuid

import pytest
import yaml
from conftest import REPO, small_config
from ray_nodes import RAY, free_port, node_env, node_root, own_ports, stop_processes_under

SECRET = "GRPO_DIST_TEST_SECRET"


@pytest.fixture(scope="module")
def token_head():
    """The job server's URL of a one-node Ray cluster with token auth (4 CPUs: a small run's actors)."""
    root = node_root("jobs")
    dashboard = free_port()
    head = [RAY, "start", "--head", f"--port={free_port()}", "--num-cpus=4", f"--temp-dir={root / 'head'}",
            f"--dashboard-port={dashboard}", "--include-dashboard=true", "--disable-usage-stats",
            *own_ports()]  # fmt: skip
    try:
        subprocess.run(head, check=True, env=node_env(), capture_output=True, timeout=180)
        yield f"http://127.0.0.1:{dashboard}"
    finally:
        stop_processes_under(root)
        shutil.rmtree(root, ignore_errors=True)


def grpo_dist(*args: str, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo_dist", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


@pytest.mark.slow
def test_a_submitted_run_is_followed_to_success_and_sees_a_forwarded_variable(token_head, tmp_path):
    secret = uuid.uuid4().hex
    work = tmp_path / "work"  # the job's files: its config only (grpo-dist and the fixtures are on the cluster)
    work.mkdir()
    raw = small_config(tmp_path, run={"output_dir": str(tmp_path / "outputs"), "steps": 2})
    digest = hashlib.sha256(secret.encode()).hexdigest()
    raw["reward"]["functions"] = [{"name": "reward_fixtures.env_reward", "kwargs": {"name": SECRET, "sha256": digest}}]
    raw["reward"]["sandbox_env"] = [SECRET]  # the sandbox gets no variable of the run's environment unless named
    (work / "run.yaml").write_text(yaml.safe_dump(raw))
    env = {**node_env(), SECRET: secret}
    result = grpo_dist("submit", str(work / "run.yaml"), "--address", token_head, "--env", SECRET,
                       "--forward-secrets", "--working-dir", str(work), env=env)  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert f"forwarded: {SECRET} (values not shown)" in result.stdout
    warning = [line for line in result.stdout.splitlines() if line.startswith("warning: --forward-secrets: ")]
    assert len(warning) == 1 and SECRET in warning[0]  # a secret by its name: forwarded only when asked, with this
    assert "Ray writes a job's runtime_env env_vars in plain text to runtime_env_agent.log on every node" in warning[0]
    assert "SUCCEEDED" in result.stdout and "): finished, step 2/2" in result.stdout  # the job's own output, followed
    assert secret not in result.stdout + result.stderr
    rows = [json.loads(line) for line in (tmp_path / "outputs" / "test" / "metrics.jsonl").read_text().splitlines()]
    assert [row["reward/mean"] for row in rows] == [1.0, 1.0]  # every completion scored where the variable was set
    job_id = result.stdout.split("submitted ", 1)[1].split()[0]
    status = grpo_dist("job", "status", job_id, "--address", token_head, env=env, timeout=60)
    assert status.returncode == 0 and f"{job_id}: SUCCEEDED" in status.stdout
    # `grpo-dist status`: the job's state and the summary the run printed as it ended, from the job's console.
    asked = grpo_dist("status", job_id, "--address", token_head, env=env, timeout=60)
    assert asked.returncode == 0, asked.stderr
    lines = asked.stdout.splitlines()
    assert lines[0] == f"job {job_id}: SUCCEEDED", asked.stdout
    assert lines[1].startswith(f"run test ({tmp_path / 'outputs' / 'test'}): finished, step 2/2, "), asked.stdout
    assert "  health: 0 warnings, 0 updates skipped, 0 rollbacks" in lines, asked.stdout


@pytest.mark.slow
def test_a_submitted_run_is_listed_scaled_through_the_address_and_stopped_with_a_checkpoint(token_head, tmp_path):
    """A running job shows in `grpo-dist job list`; `grpo-dist scale RUN_NAME --address` reaches the run with the
    job server's address alone; once stopped, the run refuses a second stop and a scale request. `grpo-dist job
    stop` is SIGTERM to the run; the wait Ray leaves before killing it (3 s by default) is raised,
    so the run finishes its stop (a checkpoint of its last finished step when the learner holds its weights) and
    saves its policy before it exits. Which of the two a stop lands on is up to timing; the checkpoint written at a
    stop is proven deterministically in test_resume.py."""
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
    listed = grpo_dist("job", "list", "--address", token_head, env=env, timeout=60)
    assert re.search(rf"^{job_id}  RUNNING  .*  train run.yaml ray.address=auto", listed.stdout, re.M), listed.stdout
    # The run reached through the cluster's address alone, by its name: the 4 CPUs are taken, so the generator
    # asked for waits (as it would for a node to join), and the run says so in its metrics.
    scaled = grpo_dist("scale", "test", "generators=2", "--address", token_head, env=env, timeout=180)
    assert scaled.returncode == 0, scaled.stdout + scaled.stderr
    assert "asked the run 'test' to go to 2 generators" in scaled.stdout
    deadline = time.monotonic() + 300
    while not any(json.loads(line).get("generators/joining") == 1 for line in metrics.read_text().splitlines()):
        assert time.monotonic() < deadline, "the run did not take the request within 300 s"
        time.sleep(1)
    stopped = grpo_dist("job", "stop", job_id, "--address", token_head, env=env, timeout=60)
    assert stopped.returncode == 0 and "asked to stop" in stopped.stdout
    deadline = time.monotonic() + 300
    while "STOPPED" not in (status := grpo_dist("job", "status", job_id, "--address", token_head, env=env)).stdout:
        assert time.monotonic() < deadline, status.stdout
        time.sleep(2)
    refused = grpo_dist("scale", "test", "generators=1", "--address", token_head, env=env, timeout=180)
    assert refused.returncode == 2 and "no run named 'test' is running on this Ray cluster" in refused.stderr
    again = grpo_dist("job", "stop", job_id, "--address", token_head, env=env, timeout=60)
    assert again.returncode == 2 and f"job {job_id} already ended (STOPPED): there is nothing to stop" in again.stderr
    assert re.search(rf"^{job_id}  STOPPED", grpo_dist("job", "list", "--address", token_head, env=env).stdout, re.M)
    logs = grpo_dist("job", "logs", job_id, "--address", token_head, env=env, timeout=60).stdout
    # The stop lands between steps (a checkpoint of the last finished one) or during the learner's update of the
    # next (whose weights belong to no finished step, so none is written, and the run says so): either way the run
    # had the time to finish its stop, which ends with the current policy saved.
    said = r"checkpoint of step \d+ written|stopped after the learner's update of step \d+: no checkpoint of it"
    assert re.search(said, logs), logs[-3000:]
    assert (tmp_path / "outputs" / "test" / "interrupted" / "model.safetensors").is_file()


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_relative_output_dir_is_refused_before_anything_is_sent(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(small_config(tmp_path, run={"output_dir": "outputs"})))
    result = grpo_dist("submit", str(config), "--address", "http://127.0.0.1:1", "--working-dir", str(tmp_path),
                       env=node_env(), timeout=60)  # fmt: skip
    assert result.returncode == 2
    assert "run.output_dir: 'outputs' is relative; a submitted run needs an absolute path" in result.stderr


LOCAL_SECRETS = {"WANDB_API_KEY": "wandb-" + "7" * 32, "HF_TOKEN": "hf_" + "x" * 30, "AWS_ACCESS_KEY_ID": "AKIA7",
                 "AWS_SECRET_ACCESS_KEY": "aws/secret+" + "k" * 20}  # fmt: skip
LOCAL_SETTINGS = {"HF_HOME": "/shared/hf", "AWS_ENDPOINT_URL": "http://minio:9000", "AWS_REGION": "eu-west-1"}


@pytest.fixture
def sent(monkeypatch, tmp_path):
    """What `grpo-dist submit` sends to the job server (stood in for: nothing is reached), one runtime_env per job;
    WANDB_API_KEY, HF_TOKEN and AWS keys set here, and settings that are not secrets."""
    from grpo_dist.ops import submit

    jobs = []
    monkeypatch.setattr(submit, "JobServer", lambda address: None)
    monkeypatch.setattr(submit, "submit_job", lambda server, entrypoint, runtime_env: jobs.append(runtime_env) or "j1")
    for name in (*submit.FORWARDED, *submit.STORE_CREDENTIALS):  # only what the test sets
        monkeypatch.delenv(name, raising=False)
    for name, value in {**LOCAL_SECRETS, **LOCAL_SETTINGS}.items():
        monkeypatch.setenv(name, value)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(small_config(tmp_path, run={"output_dir": "s3://bucket/runs"})))
    return jobs


def submit_here(tmp_path, *flags: str) -> int:
    from grpo_dist.cli import main

    return main(["submit", str(tmp_path / "run.yaml"), "--address", "http://head:8265", "--working-dir",
                 str(tmp_path), "--no-follow", *flags])  # fmt: skip


def test_secrets_are_not_forwarded_unless_asked_and_each_is_named_once(sent, tmp_path, capsys):
    assert submit_here(tmp_path) == 0
    printed = capsys.readouterr()
    assert sent[0]["env_vars"] == {"RAY_JOB_STOP_WAIT_TIME_S": "600", **LOCAL_SETTINGS}  # no secret sent to Ray
    told = [line for line in printed.out.splitlines() if line.startswith("not forwarded")]
    assert len(told) == 1 and "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, HF_TOKEN, WANDB_API_KEY;" in told[0]
    assert "runtime_env_agent.log on every node" in told[0] and "a Kubernetes Secret mounted as env vars" in told[0]
    assert "--forward-secrets" in told[0] and "warning" not in printed.out
    assert not any(value in printed.out + printed.err for value in LOCAL_SECRETS.values())


def test_forward_secrets_sends_them_with_a_one_line_warning_that_ray_logs_them(sent, tmp_path, capsys):
    assert submit_here(tmp_path, "--forward-secrets") == 0
    printed = capsys.readouterr()
    assert sent[0]["env_vars"] == {"RAY_JOB_STOP_WAIT_TIME_S": "600", **LOCAL_SETTINGS, **LOCAL_SECRETS}
    warned = [line for line in printed.out.splitlines() if line.startswith("warning: --forward-secrets: ")]
    assert len(warned) == 1
    assert "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, HF_TOKEN, WANDB_API_KEY forwarded" in warned[0]
    assert "Ray writes a job's runtime_env env_vars in plain text to runtime_env_agent.log on every node" in warned[0]
    assert "not forwarded" not in printed.out
    assert not any(value in printed.out + printed.err for value in LOCAL_SECRETS.values())


def test_an_env_secret_without_forward_secrets_is_refused_before_anything_is_sent(sent, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MY_SERVICE_TOKEN", "t0ps3cret")
    assert submit_here(tmp_path, "--env", "MY_SERVICE_TOKEN", "--env", "HF_HOME") == 2
    err = capsys.readouterr().err
    assert sent == [] and "t0ps3cret" not in err
    assert "--env MY_SERVICE_TOKEN: a secret, by its name" in err and "or pass --forward-secrets" in err
