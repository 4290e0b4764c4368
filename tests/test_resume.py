"""Checkpoints and exact resume with the real stack, driven through the command line as a user would: a run killed
with SIGKILL and resumed with `--resume` produces the same rewards and losses at every step as an uninterrupted one."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from conftest import (
    REPO,
    TESTS_DIR,
    driver_of,
    injected,
    kill_run,
    small_config,
    train_here,
    warm_shared_env,
    written_checkpoint,
)

pytestmark = pytest.mark.slow

COMPARED = ("reward/mean", "reward/std", "loss", "kl", "grad_norm", "response_length/mean")


def write_config(tmp_path, name: str, k: int = 0, model: Path | None = None, lora: dict | None = None) -> str:
    raw = small_config(tmp_path, run={"name": name, "steps": 6}, checkpoint={"every_steps": 3, "keep": 1},
                       rollout={"max_staleness": k}, learner={"lora": lora})  # fmt: skip
    # A step of at least 0.4 s (16 completions, 2 workers), the rewards unchanged: the test sees the step-3
    # checkpoint before the run writes the next.
    slow = {"name": "reward_fixtures.slow_reward", "weight": 0.0, "kwargs": {"delay_s": 0.05}}
    raw["reward"]["functions"].append(slow)
    # Runs compared to the last digit: a reward call that outlasted its bound (on a loaded machine a new reward
    # worker's first calls once took over 5 s) would leave its completion unscored in one run and not the other.
    raw["reward"]["timeout_s"] = 30  # under faults.score_timeout_s (60)
    raw["model"]["path"] = str(model or tmp_path / "model")  # shared: built once by the first run
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def grpo_dist(*args: str, warm_shared: bool = True, **kwargs) -> subprocess.Popen:
    """`python -m grpo_dist ARGS` in a new process; a run it starts has its driver, and on a cluster of its own its
    actors, forked from the session's warm process unless `warm_shared` is false (`conftest.warm_shared_env`; a
    test that kills the driver finds it with `conftest.driver_of`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ADDRESS", None)
    if warm_shared and args[:1] in (("train",), ("eval",)):
        env = warm_shared_env(env)
    return subprocess.Popen([sys.executable, "-m", "grpo_dist", *args], cwd=REPO, env=env, **kwargs)


@contextmanager
def training(tmp_path: Path, raw: dict, warm_shared: bool = True) -> Iterator[subprocess.Popen]:
    """`grpo-dist train` on the config `raw`, in the background, its output in tmp_path/run.log; killed with its
    whole session (and its forked driver's) if it is still running when the block ends (a failed test leaves nothing
    behind). `warm_shared`:
    as `grpo_dist`'s."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    with (tmp_path / "run.log").open("w") as log:
        run = grpo_dist("train", str(config), warm_shared=warm_shared, stdout=log, stderr=subprocess.STDOUT,
                        start_new_session=True)  # fmt: skip
        try:
            yield run
        finally:
            if run.poll() is None:
                kill_run(run)


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("k", [0, 1], ids=["on-policy", "k1"])
def test_a_run_killed_and_resumed_matches_the_uninterrupted_run(shared_actors, capfd, tmp_path, k):
    """At k = 1 the checkpoint holds the batch drawn ahead (sampled by the weights before the checkpoint's), which the
    resumed run trains on as the uninterrupted one does. The uninterrupted run and the resume run in this process on
    the module's shared actors (used by earlier runs: the uninterrupted run starts them from the initial model, the
    resume loads its checkpoint into them); the killed run is a command of its own, on actors of its own."""
    matches_the_uninterrupted_run(shared_actors, capfd, tmp_path, k)


def matches_the_uninterrupted_run(shared_actors, capfd, tmp_path: Path, k: int, lora: dict | None = None) -> None:
    """A 6-step run at k, whole and killed at its checkpoint then resumed, with the same figures at every step."""
    from grpo_dist.config import load_config

    whole = write_config(tmp_path, "whole", k, shared_actors.model_path, lora)
    with shared_actors.use(load_config(whole)) as actors:
        code, out = train_here(capfd, whole, cluster=actors)
        assert code == 0, out[-3000:]
        run_dir = killed_at_its_checkpoint_and_resumed(tmp_path, k, capfd, actors, lora)

    expected, got = rows(tmp_path / "outputs" / "whole"), rows(run_dir)
    assert [row["step"] for row in got] == [1, 2, 3, 4, 5, 6]  # no step duplicated or missing
    assert [row["rollout/weight_version"] for row in got] == ([0, 0, 1, 2, 3, 4] if k else [0, 1, 2, 3, 4, 5])
    for want, have in zip(expected, got, strict=True):
        for key in COMPARED:
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (want["step"], key)
    # keep: 1, and the checkpoint the run resumed from, which pruning never deletes (named in resumed-from)
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == ["latest", "resumed-from", "step-000003", "step-000006"]


def killed_at_its_checkpoint_and_resumed(tmp_path: Path, k: int, capfd, actors, lora: dict | None = None) -> Path:
    """A 6-step run (checkpoint at step 3) whose driver is SIGKILLed once the checkpoint is written, then resumed
    with `--resume` to its end (in this process, on `actors`); its run directory. The killed run joins the
    session's Ray cluster, which ends the run's actors when their driver dies."""
    import ray

    joined = f"ray.address={ray.get_runtime_context().gcs_address}"
    config = write_config(tmp_path, "resumed", k, actors.model_path, lora)
    interrupted = grpo_dist("train", config, joined, start_new_session=True)
    run_dir = tmp_path / "outputs" / "resumed"
    deadline = time.monotonic() + 600
    while not (run_dir / "checkpoints" / "latest").exists():
        assert interrupted.poll() is None and time.monotonic() < deadline, "the run ended before its checkpoint"
        time.sleep(0.1)
    driver = driver_of(interrupted)
    driver.kill()  # the driver only: the cluster has to notice by itself
    driver.wait(timeout=60)
    interrupted.wait(timeout=60)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-000003"
    for name in ("metrics.jsonl", "eval.jsonl", "completions.jsonl"):  # as a kill in the middle of a row leaves them
        with (run_dir / name).open("a") as file:
            file.write('{"step": 4, "reward/mean": 0.')

    code, out = train_here(capfd, tmp_path / "resumed.yaml", cluster=actors, resume=True)
    assert code == 0, out[-3000:]
    assert "after step 3" in out
    assert out.count("dropped its last line, torn by a crash mid-write") == 3, out
    return run_dir


def test_a_run_resumed_at_k2_takes_every_step_once_and_keeps_the_bound(shared_actors, capfd, tmp_path):
    """At k = 2 the generators may hold weights older than the checkpoint's when it is written; the resumed run's
    start from the checkpoint's, so its batches may be fresher than the uninterrupted run's, never staler than k."""
    from grpo_dist.config import load_config

    config = write_config(tmp_path, "resumed", 2, shared_actors.model_path)
    with shared_actors.use(load_config(config)) as actors:
        got = rows(killed_at_its_checkpoint_and_resumed(tmp_path, 2, capfd, actors))
    assert [row["step"] for row in got] == [1, 2, 3, 4, 5, 6]
    assert all(row["staleness/max"] <= 2 for row in got)
    versions = [row["rollout/weight_version"] for row in got]
    assert versions == sorted(versions)  # no batch from weights older than an earlier step's
    assert max(row["staleness/max"] for row in got) >= 1  # the bound was in play: some batches were stale


def test_a_lora_run_killed_and_resumed_matches_the_uninterrupted_run(shared_actors, capfd, tmp_path):
    """As at k = 1 (above), with a LoRA adapter served as one: the checkpoint holds the adapter and its optimizer
    state, and the resumed run's engines get the adapter of step 3 where the uninterrupted run's got every version
    since 1. After the runs without an adapter, which share one set of actors (this one needs its own)."""
    matches_the_uninterrupted_run(shared_actors, capfd, tmp_path, 1, {"rank": 4, "alpha": 16})


def test_resume_refuses_a_changed_group_size(tmp_path):
    from grpo_dist.config import ConfigError, validate_config
    from grpo_dist.run import checkpoints
    from grpo_dist.storage.run_dir import open_run

    raw = small_config(tmp_path)
    checkpoint = written_checkpoint(tmp_path / "step-000003", raw)
    raw["rollout"]["group_size"] = 8
    raw["learner"]["lr"] = 5e-3
    cfg = validate_config(raw)
    with pytest.raises(ConfigError, match=r"rollout.group_size: 4 -> 8"):
        checkpoints.check_config(cfg, checkpoints.find(open_run(cfg)[1], str(checkpoint)))
    raw["rollout"]["group_size"] = 4
    changed = validate_config(raw)
    assert checkpoints.check_config(changed, checkpoints.find(open_run(changed)[1], str(checkpoint))) == [
        "learner.lr: 0.01 -> 0.005"
    ]


def test_resume_reports_no_change_for_the_same_nan_or_a_setting_added_since_left_empty(tmp_path):
    """A rehearsal's NaN loss factor (`faults.inject`) is the same NaN when resumed, and a config saved before a
    setting existed does not have it: neither is a change. Injecting where the saved config did not is one."""
    from grpo_dist.config import validate_config
    from grpo_dist.run import checkpoints
    from grpo_dist.storage import manifest
    from grpo_dist.storage.run_dir import open_run

    nan_loss = injected(small_config(tmp_path), scale_loss=[{"step": 3, "factor": math.nan}])
    checkpoint = written_checkpoint(tmp_path / "step-000003", nan_loss)
    cfg = validate_config(nan_loss)
    assert checkpoints.check_config(cfg, checkpoints.find(open_run(cfg)[1], str(checkpoint))) == []
    saved = yaml.safe_load((checkpoint / "config.yaml").read_text())
    del saved["faults"]["inject"]  # as written before `faults.inject` existed
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(saved))
    manifest.write(checkpoint)
    plain = validate_config(small_config(tmp_path))
    assert checkpoints.check_config(plain, checkpoints.find(open_run(plain)[1], str(checkpoint))) == []
    changes = checkpoints.check_config(cfg, checkpoints.find(open_run(cfg)[1], str(checkpoint)))
    assert changes == ["faults.inject.scale_loss: None -> [{'step': 3, 'factor': nan, 'once': False}]"]


def test_sigterm_while_a_step_is_scored_checkpoints_the_last_finished_step(tmp_path):
    """Preemption or `ray job stop`: SIGTERM mid-run writes interrupted/ and exits 130 with no traceback. The signal
    lands while a step's completions are being scored, which at rollout.max_staleness 0 comes before the learner's
    update of that step, so the run also writes a checkpoint of the last finished step and points `latest` at it."""
    raw = small_config(tmp_path, run={"name": "stopped", "steps": 50}, checkpoint={"every_steps": 1000})
    # Weight 0, the rewards unchanged: instant until `slow` exists, then it creates `scoring` and takes 0.5 s per
    # completion, so the step being scored when the signal comes is still being scored when the signal lands.
    signals = tmp_path / "signals"
    signals.mkdir()
    signals.chmod(0o777)  # the reward writes here from its sandbox, which runs as `nobody` under root
    gate = {"name": "reward_fixtures.slow_once_asked", "weight": 0.0, "kwargs": {"signal_dir": str(signals)}}
    raw["reward"]["functions"].append(gate)
    raw["reward"]["sandbox_paths"] = [str(signals)]  # the sandbox sees it, at its own path
    path = tmp_path / "stopped.yaml"
    path.write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "outputs" / "stopped"
    with (tmp_path / "out.log").open("w") as out_log, (tmp_path / "err.log").open("w") as err_log:
        run = grpo_dist("train", str(path), stdout=out_log, stderr=err_log, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while not (run_dir / "metrics.jsonl").exists() or len(rows(run_dir)) < 2:
                assert run.poll() is None and time.monotonic() < deadline, "the run ended before its second step"
                time.sleep(0.2)
            (signals / "slow").touch()
            while not (signals / "scoring").exists():
                assert run.poll() is None and time.monotonic() < deadline, "no step was scored after the second"
                time.sleep(0.05)
            run.send_signal(signal.SIGTERM)
            run.wait(timeout=300)
        finally:
            if run.poll() is None:
                kill_run(run)
    out, err = (tmp_path / "out.log").read_text(), (tmp_path / "err.log").read_text()
    assert run.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "--resume" in err
    assert (run_dir / "interrupted" / "model.safetensors").is_file()
    finished = rows(run_dir)[-1]["step"]  # the last step the learner updated on: the signal came in the next one
    assert finished >= 2
    assert f"checkpoint of step {finished} written" in out, out[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{finished:06d}"
    assert (run_dir / "checkpoints" / f"step-{finished:06d}").is_dir()
