"""The divergence guard: its checks on hand-made step metrics (no Ray), and real runs whose loss a test hook poisons
(`faults.SCALE_LOSS`): a non-finite step is dropped and the run goes on, a gradient spike is rolled back to the
latest checkpoint with its batch skipped, and the same spike twice stops the run."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time

import pytest
import torch
from conftest import small_config
from test_resume import rows, training

from grpo_dist.config import HealthConfig, validate_config
from grpo_dist.faults import DROP_WEIGHTS, SCALE_LOSS, SCALE_LR, StepFactors
from grpo_dist.health import Guard


def guard_with(history: dict[str, list[float]], **settings) -> Guard:
    guard = Guard(HealthConfig(min_history=3, **settings))
    for index in range(max(len(values) for values in history.values())):
        guard.record({key: values[index] for key, values in history.items() if index < len(values)})
    return guard


STEADY = {"grad_norm": [1.0, 2.0, 3.0], "entropy": [2.0, 2.0, 2.0], "reward/mean": [0.4, 0.5, 0.6]}
HEALTHY = {"loss": 0.1, "grad_norm": 2.5, "entropy": 1.9, "reward/mean": 0.5, "kl": 0.01, "logprob_gap": 0.02}


@pytest.mark.parametrize(
    ("changed", "check", "action", "figures"),
    [
        pytest.param({"loss": math.nan}, "nonfinite", "skip", "loss nan", id="nan-loss"),
        pytest.param({"grad_norm": math.inf}, "nonfinite", "skip", "gradient norm inf", id="inf-grad"),
        pytest.param({"learner/skipped": 1.0}, "nonfinite", "skip", "loss 0.1", id="dropped-by-the-optimizer"),
        # median of [1, 2, 3] = 2; 10 x 2 = 20 < 21
        pytest.param({"grad_norm": 21.0}, "grad_norm", "rollback", "gradient norm 21 against a median of 2", id="up"),
        pytest.param({"kl": 1.5}, "kl", "warn", "KL to the reference 1.5 > 1", id="kl"),
        pytest.param({"logprob_gap": 1.2}, "logprob_gap", "warn", "log-prob gap 1.2 per token > 1", id="gap"),
        # median 2; 0.1 x 2 = 0.2 > 0.19
        pytest.param({"entropy": 0.19}, "entropy", "warn", "entropy 0.19 against a median of 2", id="entropy"),
        # median 0.5; 0.25 x 0.5 = 0.125 > 0.1
        pytest.param({"reward/mean": 0.1}, "reward", "warn", "mean reward 0.1 against a median of 0.5", id="reward"),
    ],
)
def test_each_check_fires_past_its_bound_with_its_default_action(changed, check, action, figures):
    guard = guard_with(STEADY)
    assert guard.check(4, HEALTHY) == []
    (event,) = guard.check(4, {**HEALTHY, **changed})
    assert (event.step, event.check, event.action) == (4, check, action)
    assert figures in event.figures, event.figures


def test_a_spike_must_also_pass_the_clip_and_steps_without_signal_set_no_baseline():
    """A run whose first steps had every advantage 0 (gradient norm 0) and then one with a signal: no spike."""
    guard = Guard(HealthConfig(min_history=3), clip=1.0)
    for _ in range(5):
        guard.record({"grad_norm": 0.0})
    assert guard.check(6, {"loss": 0.0, "grad_norm": 0.66}) == []  # no history: the zeros are not one
    for norm in (0.01, 0.02, 0.03):
        guard.record({"grad_norm": norm})
    # median 0.02: 10 x 0.02 = 0.2 < 0.66, but 0.66 is under the clip (1.0): the update is a usual one
    assert guard.check(9, {"loss": 0.0, "grad_norm": 0.66}) == []
    assert [event.check for event in guard.check(9, {"loss": 0.0, "grad_norm": 1.5})] == ["grad_norm"]


def test_the_history_is_judged_only_once_it_is_long_enough_and_only_while_the_reward_median_is_positive():
    short = guard_with({"grad_norm": [1.0, 1.0]})  # 2 steps < min_history 3
    assert short.check(3, {"loss": 0.0, "grad_norm": 1000.0}) == []
    negative = guard_with({"reward/mean": [-0.5, -0.4, -0.6]})
    assert negative.check(4, {"loss": 0.0, "grad_norm": 1.0, "reward/mean": -3.0}) == []
    windowed = guard_with({"grad_norm": [100.0, 100.0, 1.0, 1.0, 1.0]}, window=3)  # the 100s fell out of the window
    assert [event.check for event in windowed.check(6, {"loss": 0.0, "grad_norm": 11.0})] == ["grad_norm"]


def test_the_most_severe_action_comes_first_and_off_is_silent():
    guard = guard_with(STEADY, kl={"action": "off"})
    events = guard.check(4, {**HEALTHY, "kl": 5.0, "grad_norm": 100.0, "entropy": 0.01})
    assert [(event.check, event.action) for event in events] == [("grad_norm", "rollback"), ("entropy", "warn")]


def test_a_rollback_restores_the_checkpoints_history_and_remembers_the_cause_across_a_checkpoint():
    guard = guard_with(STEADY)
    (event,) = guard.check(4, {**HEALTHY, "grad_norm": 50.0})
    assert not guard.again(event)
    guard.rolled_back(event, {"grad_norm": [1.0], "entropy": [], "reward/mean": []})
    assert guard.history["grad_norm"] == [1.0]
    resumed = Guard(HealthConfig(min_history=3))
    resumed.load_state_dict(guard.state_dict())
    assert resumed.again(event) and resumed.metrics()["health/rollbacks"] == 1.0
    assert not resumed.again(type(event)(5, "grad_norm", "rollback", ""))  # another step: not the same cause


def test_skip_is_an_action_of_the_nonfinite_check_only(tmp_path):
    base = small_config(tmp_path)
    with pytest.raises(ValueError, match="health.grad_norm.action"):
        validate_config({**base, "health": {"grad_norm": {"action": "skip"}}})
    assert validate_config({**base, "health": {"nonfinite": {"action": "rollback"}}}).health.nonfinite.action == (
        "rollback"
    )


def test_the_loss_hook_scales_its_steps_and_once_only_the_first_time(monkeypatch):
    monkeypatch.setenv(SCALE_LOSS, "2:nan,4:1e6:once")
    hook = StepFactors.from_environment(SCALE_LOSS)
    assert hook.factor(1) == 1.0 and math.isnan(hook.factor(2)) and hook.factor(4) == 1e6
    hook.trained(2)
    hook.trained(4)
    assert math.isnan(hook.factor(2)) and hook.factor(4) == 1.0


def health_run(tmp_path, steps: int, every_steps: int = 1, **health) -> dict:
    return small_config(
        tmp_path,
        run={"steps": steps},
        checkpoint={"every_steps": every_steps, "keep": 4},
        # Only the injected causes may fire: a natural spike of a tiny model's gradient stays far under 1000x.
        health={"min_history": 2, "grad_norm": {"factor": 1000.0}, **health},
    )


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "final" / "model.safetensors")


@pytest.mark.slow
def test_a_poisoned_step_is_dropped_and_a_spike_is_rolled_back_with_its_batch_skipped(tmp_path, monkeypatch):
    """Step 3's loss is NaN: its update is dropped (the learner leaves the weights alone) and the run goes on. Step
    6's loss is scaled a million times the first time it is trained: its gradient norm spikes against the median
    of the steps before, the learner and generators go back to the step-5 checkpoint, and step 6 is trained again on
    the next batch. Every step is logged once; the rollback is counted and kept in the checkpoints after it."""
    from grpo_dist import safe_load
    from grpo_dist.checkpoints import RUN_STATE_CLASSES

    monkeypatch.setenv(SCALE_LOSS, "3:nan,6:1e6:once")
    run_dir = tmp_path / "outputs" / "test"
    with training(tmp_path, health_run(tmp_path, 8)) as run:
        assert run.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
    output = (tmp_path / "run.log").read_text()
    logged = rows(run_dir)
    assert [row["step"] for row in logged] == list(range(1, 9))
    by_step = {row["step"]: row for row in logged}
    assert by_step[3]["learner/skipped"] == 1.0 and by_step[3]["health/skipped"] == 1.0
    assert all(by_step[step]["learner/skipped"] == 0.0 for step in (1, 2, 4, 5, 6, 7, 8))
    assert by_step[5]["health/rollbacks"] == 0.0 and by_step[6]["health/rollbacks"] == 1.0
    assert by_step[8]["faults/rollbacks"] == 1.0
    assert by_step[6]["grad_norm"] < 1000 * by_step[5]["grad_norm"]  # the step that stands is the healthy one
    health = [line for line in output.splitlines() if line.startswith("health: ")]
    print("\n".join(health))
    assert len(health) == 3, health  # the drop, the spike, the rollback
    assert health[0].startswith("health: step 3: loss") and health[0].endswith("the update was dropped")
    assert health[1].startswith("health: step 6: gradient norm") and health[1].endswith("rolling back")
    assert health[2].startswith("health: rolled back to step 5") and "the batches of step 6 skipped" in health[2]
    assert all(torch.isfinite(tensor).all() for tensor in final_weights(run_dir).values())
    # `grpo-dist status` reads the same from the run's files as the run printed last.
    shown = subprocess.run([sys.executable, "-m", "grpo_dist", "status", str(run_dir)], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    print(shown.stdout)
    summary = shown.stdout.splitlines()
    assert summary[0].startswith(f"run test ({run_dir}): finished, step 8/8, ")
    assert "  health: 0 warnings, 1 updates skipped, 1 rollbacks" in summary
    assert "  faults: rollbacks 1" in summary
    events = summary[summary.index("  last events (3 of 3):") + 1 :][:3]
    assert [event.split(": ", 1)[1] for event in events] == [
        re.sub(r"^health: (step \d+: )?", "", line) for line in health
    ]
    assert output.splitlines()[-len(summary) :] == summary, output[-3000:]
    states = {
        step: safe_load.load(run_dir / "checkpoints" / f"step-{step:06d}" / "run_state.pt", RUN_STATE_CLASSES)
        for step in (5, 8)
    }
    assert states[8]["health"]["rolled_back_from"] == [("grad_norm", 6)]
    assert states[8]["health"]["counts"] == {"warnings": 0, "skipped": 1, "rollbacks": 1}
    # The step-5 checkpoint, written again after the rollback, stands past 6 batches (a resume from it skips the
    # first step-6 batch too), and the run drew 9 batches for its 8 steps: 9 / 6 (without the skip: 8 / 5).
    positions = {step: state["sampler"]["position"] for step, state in states.items()}
    assert positions[8] * 6 == positions[5] * 9, positions
    assert states[5]["health"]["counts"]["rollbacks"] == 1


@pytest.mark.slow
def test_the_same_spike_after_a_rollback_stops_the_run_naming_its_check_step_and_figures(tmp_path, monkeypatch):
    """Without checkpoints, the rollback goes back to the initial model (steps 1 and 2 trained again), where step 3
    spikes again."""
    monkeypatch.setenv(SCALE_LOSS, "3:1e6")  # every time step 3 is trained
    run_dir = tmp_path / "outputs" / "test"
    with training(tmp_path, health_run(tmp_path, 5, every_steps=0)) as run:
        assert run.wait(timeout=600) == 1, (tmp_path / "run.log").read_text()[-3000:]
    output = (tmp_path / "run.log").read_text()
    assert [row["step"] for row in rows(run_dir)] == [1, 2]
    assert "health: rolled back to step 0 in" in output and "the batches of steps 1-3 skipped" in output
    assert len(re.findall(r"^step +2/5 ", output, re.M)) == 2  # trained again from the initial model
    stop = next(line for line in output.splitlines() if "the same cause twice" in line)
    assert "step 3: gradient norm" in stop and "(health.grad_norm)" in stop, stop
    assert (run_dir / "interrupted").is_dir()
    print(stop)
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2


@pytest.mark.slow
def test_each_other_check_catches_its_injected_cause_at_the_step_it_shows(tmp_path, monkeypatch):
    """One run, every check warning only, each cause injected at its own step:
    - the engines serve the initial weights labelled as version 2 (`DROP_WEIGHTS`, the sync check off): the batch
      of step 3 is sampled by other weights than the learner's, the log-prob gap check fires at step 3;
    - the reward's flag file is removed once step 3 is logged: the mean reward collapses a step or two later;
    - step 6 is trained at 300 times the learning rate (`SCALE_LR`): its update wrecks the weights, and step 7's
      KL to the reference and entropy show it."""
    flag = tmp_path / "reward-on"
    flag.write_text("")
    monkeypatch.setenv(DROP_WEIGHTS, "2:once")
    monkeypatch.setenv(SCALE_LR, "6:300")
    warn = {"action": "warn"}
    raw = health_run(
        tmp_path, 8, every_steps=0, grad_norm=warn, kl={**warn, "max": 1.0}, logprob_gap={**warn, "max": 1e-3},
        entropy={**warn, "fraction": 0.5}, reward={**warn, "fraction": 0.5},
    )  # fmt: skip
    raw["sync"] = {"probe": False}  # the sync check would catch the dropped weights first and send them again
    raw["reward"]["sandbox"] = False  # the flag file is outside what a sandbox sees
    raw["reward"]["functions"].append({"name": "reward_fixtures.flag_reward", "weight": 1.0,
                                       "kwargs": {"path": str(flag)}})  # fmt: skip
    run_dir = tmp_path / "outputs" / "test"
    with training(tmp_path, raw) as run:
        while run.poll() is None and not any(row["step"] >= 3 for row in rows_so_far(run_dir)):
            time.sleep(0.05)
        flag.unlink()
        assert run.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
    output = (tmp_path / "run.log").read_text()
    health = [line for line in output.splitlines() if line.startswith("health: ")]
    print("\n".join(health))
    fired = {(int(line.split()[2].rstrip(":")), line.split("(health.")[1].split(")")[0]) for line in health}
    assert (3, "logprob_gap") in fired
    assert any(check == "reward" and step in (4, 5) for step, check in fired), fired
    assert {(7, "kl"), (7, "entropy")} <= fired, fired
    assert all(line.endswith(": a warning") for line in health)
    assert [row["step"] for row in rows(run_dir)] == list(range(1, 9))


def rows_so_far(run_dir) -> list[dict]:
    try:
        return rows(run_dir)
    except (FileNotFoundError, json.JSONDecodeError):
        return []
