"""The divergence guard: its checks on hand-made step metrics (no Ray), and real runs whose loss is poisoned on purpose
(`faults.inject.scale_loss`): a non-finite step is dropped and the run goes on, a gradient spike is rolled back to the
latest checkpoint with its batch skipped, and the same spike twice stops the run."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import cli_here, injected, small_config, train_config_here
from test_resume import rows

from grpo_dist.config import ConfigError, HealthConfig, InjectConfig, load_config, validate_config
from grpo_dist.faults.inject import Injector, describe
from grpo_dist.run.health import Event, Guard
from grpo_dist.run.recovery import why_no_rollback
from grpo_dist.storage.run_dir import open_run


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
        # median of [1, 2, 3] = 2; 1000 x 2 = 2000 < 2001
        pytest.param({"grad_norm": 2001.0}, "grad_norm", "warn", "gradient norm 2001 against a median of 2", id="up"),
        pytest.param({"kl": 1.5}, "kl", "warn", "KL to the reference 1.5 > 1", id="kl"),
        pytest.param({"logprob_gap": 1.2}, "logprob_gap", "warn", "log-prob gap 1.2 per token > 1", id="gap"),
        # median 2; 0.1 x 2 = 0.2 > 0.19, the reward under its median 0.5
        pytest.param(
            {"entropy": 0.19, "reward/mean": 0.45}, "entropy", "rollback", "entropy 0.19 against a median", id="entropy"
        ),
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


def test_the_gap_of_a_batch_drawn_ahead_is_the_policys_own_move_and_no_fault():
    """At k = 2 with in-flight updates the quick start's learner is 1.9 nats a token from the engines that sampled
    two updates ago while it learns (`benchmarks/overlap.py --parts corrections`, seed 0 of seq_mis; two more steps
    at seed 1 of tis): the engines are not apart, the policy moved. The check judges fresh batches only."""
    guard = guard_with(STEADY)
    assert guard.check(4, {**HEALTHY, "logprob_gap": 1.897, "staleness/max": 2.0}) == []
    (event,) = guard.check(4, {**HEALTHY, "logprob_gap": 1.897, "staleness/max": 0.0})
    assert event.check == "logprob_gap"


def test_a_gradient_spike_at_the_moment_of_learning_is_silent_and_three_orders_of_magnitude_warn():
    """The quick start at seed 0 (`benchmarks/guard.py`): the norm hovers about 0.44, then 4.94 at step 44 as
    groups first get signal (11x): silent, and the norm is over the clip. 1000x the median warns only."""
    guard = Guard(HealthConfig(), clip=1.0)
    for norm in (0.45, 0.42, 0.44, 0.47, 0.43):
        guard.record({"grad_norm": norm})
    assert guard.check(44, {"loss": 0.0, "grad_norm": 4.94}) == []
    (event,) = guard.check(44, {"loss": 0.0, "grad_norm": 445.0})  # median 0.44; 1000 x 0.44 = 440 < 445
    assert (event.check, event.action) == ("grad_norm", "warn")
    assert event.what().startswith("a gradient spike: gradient norm 445 against a median of 0.44")


def test_a_spike_must_also_pass_the_clip_and_steps_without_signal_set_no_baseline():
    """A run whose first steps had every advantage 0 (gradient norm 0) and then one with a signal: no spike."""
    guard = Guard(HealthConfig(grad_norm={"factor": 10.0}), clip=1.0)
    for _ in range(5):
        guard.record({"grad_norm": 0.0})
    assert guard.check(6, {"loss": 0.0, "grad_norm": 0.66}) == []  # no history: the zeros are not one
    for norm in (0.01, 0.02, 0.03):
        guard.record({"grad_norm": norm})
    # median 0.02: 10 x 0.02 = 0.2 < 0.66, but 0.66 is under the clip (1.0): the update is a usual one
    assert guard.check(9, {"loss": 0.0, "grad_norm": 0.66}) == []
    assert [event.check for event in guard.check(9, {"loss": 0.0, "grad_norm": 1.5})] == ["grad_norm"]


def test_a_diverging_policy_is_named_at_the_second_step_and_the_reward_waits_for_its_history():
    """Learning rate 50 from the start (the quick start, `benchmarks/guard.py`): step 1's update wrecks the weights,
    and step 2's entropy is 0 against step 1's 2.69, reward and gradient norm 0. One step of history is enough for
    the entropy and the gradient norm; the reward, noisy while small, waits for `min_history` steps."""
    guard = Guard(HealthConfig(), clip=1.0)
    assert guard.check(1, {"loss": 0.0, "grad_norm": 1.55, "entropy": 2.69, "reward/mean": 0.098}) == []
    guard.record({"loss": 0.0, "grad_norm": 1.55, "entropy": 2.69, "reward/mean": 0.098})
    (event,) = guard.check(2, {"loss": 0.0, "grad_norm": 0.0, "entropy": 0.0, "reward/mean": 0.0})
    assert (event.check, event.action) == ("entropy", "rollback")
    assert str(event) == (
        "step 2: divergence (entropy collapse): entropy 0 against a median of 2.69 over the last step (bound 0.1x), "
        "mean reward 0 against a median of 0.098 (health.entropy)"
    )
    short = guard_with({"reward/mean": [0.5, 0.5]})  # 2 steps < min_history 3
    assert short.check(3, {"loss": 0.0, "reward/mean": 0.0}) == []
    negative = guard_with({"reward/mean": [-0.5, -0.4, -0.6]})
    assert negative.check(4, {"loss": 0.0, "grad_norm": 1.0, "reward/mean": -3.0}) == []
    windowed = guard_with({"grad_norm": [1e5, 1e5, 1.0, 1.0, 1.0]}, window=3)  # the 1e5s fell out of the window
    assert [event.check for event in windowed.check(6, {"loss": 0.0, "grad_norm": 1001.0})] == ["grad_norm"]


def test_one_update_that_throws_the_policy_off_is_named_and_a_healthy_fall_is_not():
    """Step 6 of the quick start trained at 300x its learning rate (`benchmarks/guard.py`'s lr_spike): step 7's
    entropy is 1.035 after 2.55, 2.54, 2.52, under half the lowest of the last 3 steps' though far above a tenth of
    the window's median, and its mean reward 0.1035 is under each of theirs. The steepest fall of the quick start's
    healthy runs at seeds 0-4, at the moment of learning, is 0.74x the last 3 steps' median."""
    guard = Guard(HealthConfig(), clip=1.0)
    lead_up = ((2.69, 0.098), (2.66, 0.119), (2.59, 0.142), (2.55, 0.134), (2.54, 0.1305), (2.52, 0.1457))
    for entropy, reward in lead_up:
        guard.record({"grad_norm": 0.5, "entropy": entropy, "reward/mean": reward})
    healthy = {"loss": 0.0, "grad_norm": 0.5, "entropy": 0.74 * 2.54, "reward/mean": 0.1035}
    assert guard.check(7, healthy) == []
    (event,) = guard.check(7, {**healthy, "entropy": 1.035})
    assert (event.check, event.action) == ("entropy", "rollback")
    assert event.figures == (
        "entropy 1.035 against a low of 2.52 over the last 3 steps (bound 0.5x), mean reward 0.1035 against a low "
        "of 0.1305"
    )
    assert guard.check(7, {**healthy, "entropy": 1.035, "reward/mean": 0.1305}) == []  # the reward held


def test_a_policy_collapsing_onto_what_scores_is_converging_not_diverging():
    """The tests' tiny config (`small_config`, learning rate 1e-2, seed 0; `benchmarks/guard.py`'s tests-small-0)
    at steps 27-30, where a run of `make test` was stopped for divergence: the entropy fell from 1.42 to 0.68, under
    half the last 3 steps' median, while the mean reward rose to 0.8, its best. At seed 1 it falls from 1.95 to
    0.003 in one step at reward 0.9, and stays there. A break that costs reward is still named, as is a fall below a
    tenth of the window's median with the reward under the window's."""
    guard = Guard(HealthConfig(), clip=1.0)
    for entropy, reward in ((1.771, 0.6125), (1.421, 0.7188), (0.899, 0.775)):
        guard.record({"grad_norm": 1.0, "entropy": entropy, "reward/mean": reward})
    assert guard.check(30, {"loss": 0.0, "grad_norm": 0.69, "entropy": 0.6808, "reward/mean": 0.8}) == []
    converged = Guard(HealthConfig(), clip=1.0)
    for entropy in (2.66, 2.42, 1.95):
        converged.record({"grad_norm": 0.1, "entropy": entropy, "reward/mean": 0.9})
    assert converged.check(77, {"loss": 0.0, "grad_norm": 1e-4, "entropy": 0.0026, "reward/mean": 0.9}) == []
    (event,) = converged.check(77, {"loss": 0.0, "grad_norm": 1e-4, "entropy": 0.0026, "reward/mean": 0.85})
    assert event.check == "entropy" and "against a median of 2.42" in event.figures, event.figures
    trend = Guard(HealthConfig(), clip=1.0)  # falling steadily: 0.41 is not under half the lowest of the last 3
    for entropy in (2.18, 1.055, 0.597):
        trend.record({"grad_norm": 1.0, "entropy": entropy, "reward/mean": 0.8})
    assert trend.check(46, {"loss": 0.0, "grad_norm": 1.3, "entropy": 0.41, "reward/mean": 0.74}) == []


def test_a_sharp_policy_sharpening_is_not_a_collapse():
    """The agent demo, warmed up, at its first steps (`benchmarks/guard.py`): its entropy goes from 0.61 to 0.11 in
    9 healthy steps while its reward rises. At step 9, 0.1073 is under half the last 3 steps' median (0.25), but
    it fell 0.14 nats, under `min_fall` (0.5): silent. The quick start's lr spike fell 1.5 nats."""
    guard = Guard(HealthConfig(), clip=1.0)
    for entropy, reward in zip((0.612, 0.427, 0.691, 0.43, 0.443, 0.352, 0.25, 0.178),
                               (0.506, 0.65, 0.427, 0.708, 0.708, 0.809, 0.788, 0.755), strict=True):  # fmt: skip
        metrics = {"loss": 0.0, "grad_norm": 0.9, "entropy": entropy, "reward/mean": reward}
        assert guard.check(1, metrics) == []
        guard.record(metrics)
    assert guard.check(9, {"loss": 0.0, "grad_norm": 1.2, "entropy": 0.1073, "reward/mean": 0.8}) == []
    assert [event.check for event in guard.check(9, {"loss": 0.0, "grad_norm": 1.2, "entropy": 0.0})] == []
    strict = Guard(HealthConfig(entropy={"min_fall": 0.0}), clip=1.0)
    strict.history = {key: list(values) for key, values in guard.history.items()}
    collapsed = {"loss": 0.0, "grad_norm": 1.2, "entropy": 0.0, "reward/mean": 0.7}
    assert [event.check for event in strict.check(9, collapsed)] == ["entropy"]


TRACES = json.loads((Path(__file__).parent / "guard_traces.json").read_text())
"""Every healthy run of `benchmarks/guard.py` (each shipped CPU recipe with its defaults, the quick start at seeds
0-4): the figures the guard read at each step, a row of `keys` a step (`--traces`)."""


@pytest.mark.parametrize("recipe", sorted(TRACES["runs"]))
def test_the_defaults_are_silent_on_every_shipped_recipes_recorded_healthy_run(recipe):
    """Silent, but for the warnings a run's figures truly earn (the tests' tiny config sits at a KL of 2-3 against
    the bound of 1, and at seed 1 its reward falls from 0.9 to 0.17 for a few steps): nothing rolls back or stops."""
    guard = Guard(HealthConfig(), clip=1.0)  # every recipe's learner.max_grad_norm
    steps, warns = TRACES["runs"][recipe], set(TRACES["warns"][recipe])
    for step, row in enumerate(steps, start=1):
        metrics = {key: value for key, value in zip(TRACES["keys"], row, strict=True) if value is not None}
        events = guard.check(step, metrics)
        assert all(event.check in warns and event.action == "warn" for event in events), (
            recipe, step, [str(event) for event in events])  # fmt: skip
        guard.record(metrics, events)
    assert len(guard.history["entropy"]) == min(len(steps), guard.cfg.window)


def test_a_figure_that_fires_sets_no_baseline_so_a_collapse_that_persists_keeps_firing():
    guard = guard_with(STEADY, entropy={"action": "warn"})
    for step in (4, 5, 6):
        collapsed = {**HEALTHY, "entropy": 0.01, "reward/mean": 0.3}
        events = guard.check(step, collapsed)
        assert [event.check for event in events] == ["entropy"], step
        guard.record(collapsed, events)
    assert guard.history["entropy"] == [2.0, 2.0, 2.0]
    assert guard.history["grad_norm"] == [1.0, 2.0, 3.0, 2.5, 2.5, 2.5]  # the checks that did not fire took theirs
    assert guard.history["reward"] == [0.4, 0.5, 0.6]  # the reward a collapse lost sets no baseline either


def test_the_most_severe_action_comes_first_and_off_is_silent():
    guard = guard_with(STEADY, kl={"action": "off"})
    events = guard.check(4, {**HEALTHY, "kl": 5.0, "grad_norm": 5000.0, "entropy": 0.01, "reward/mean": 0.3})
    assert [(event.check, event.action) for event in events] == [("entropy", "rollback"), ("grad_norm", "warn")]


def test_off_as_yaml_reads_it_turns_a_check_off(tmp_path):
    """YAML reads a bare `off` as false: in a config file and in a dotted override it still means the action."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(small_config(tmp_path)) + "health:\n  entropy: {action: off}\n")
    cfg = load_config(path, ["health.grad_norm.action=off"])
    assert (cfg.health.entropy.action, cfg.health.grad_norm.action) == ("off", "off")
    with pytest.raises(ConfigError, match="health.kl.action"):
        load_config(path, ["health.kl.action=true"])


def test_a_rollback_restores_the_checkpoints_history_and_remembers_the_cause_across_a_checkpoint():
    guard = guard_with(STEADY)
    (event,) = guard.check(4, {**HEALTHY, "entropy": 0.01, "reward/mean": 0.3})
    assert not guard.again(event)
    guard.rolled_back(event, {"grad_norm": [1.0], "entropy": [], "reward/mean": []})
    assert guard.history["grad_norm"] == [1.0]
    resumed = Guard(HealthConfig(min_history=3))
    resumed.load_state_dict(guard.state_dict())
    assert resumed.again(event) and resumed.metrics()["health/rollbacks"] == 1.0
    assert not resumed.again(type(event)(5, "entropy", "rollback", ""))  # another step: not the same cause


@pytest.mark.parametrize(
    ("step", "said"),
    [
        pytest.param(2, "", id="step-2-back-to-the-initial-model"),
        pytest.param(
            30, "; no checkpoint to roll back to yet (the first is due at step 50: checkpoint.every_steps), and going"
            " back to the initial model would throw away steps 1-29: stopped instead (the policy is saved in"
            " interrupted/)", id="step-30-stops",
        ),
    ],
)  # fmt: skip
def test_before_the_first_checkpoint_a_rollback_undoes_one_of_the_first_steps_only(tmp_path, step, said):
    cfg, run = open_run(validate_config(small_config(tmp_path, checkpoint={"every_steps": 50})))
    guard = guard_with(STEADY)
    event = Event(step, "entropy", "rollback", "entropy 0 against a median of 2")
    assert why_no_rollback(cfg, run, SimpleNamespace(first_step=0), guard, event) == said
    guard.rolled_back(event, None)
    assert why_no_rollback(cfg, run, SimpleNamespace(first_step=0), guard, event) == (
        f", again after rolling back from step {step}: the same cause twice"
    )


def test_skip_is_an_action_of_the_nonfinite_check_only(tmp_path):
    base = small_config(tmp_path)
    with pytest.raises(ValueError, match="health.grad_norm.action"):
        validate_config({**base, "health": {"grad_norm": {"action": "skip"}}})
    assert validate_config({**base, "health": {"nonfinite": {"action": "rollback"}}}).health.nonfinite.action == (
        "rollback"
    )


def test_an_injected_loss_factor_scales_its_steps_and_once_only_the_first_time():
    inject = InjectConfig(scale_loss=[{"step": 2, "factor": math.nan}, {"step": 4, "factor": 1e6, "once": True}])
    hook = Injector(inject)
    assert hook.loss_factor(1) == 1.0 and math.isnan(hook.loss_factor(2)) and hook.loss_factor(4) == 1e6
    assert hook.lr_factor(4) == 1.0  # the loss's factors only
    hook.trained(2)
    hook.trained(4)
    assert math.isnan(hook.loss_factor(2)) and hook.loss_factor(4) == 1.0
    assert Injector(inject).loss_factor(4) == 1e6  # a new run's injector: nothing met yet
    assert describe(inject) == "injecting faults (faults.inject): loss xnan at step 2; loss x1e+06 at step 4 once"


def test_nothing_is_injected_unless_the_config_lists_it(tmp_path):
    cfg = validate_config(small_config(tmp_path))
    hook = Injector(cfg.faults.inject)
    assert describe(cfg.faults.inject) is None
    assert [hook.loss_factor(step) for step in range(1, 9)] == [1.0] * 8
    assert [hook.lr_factor(step) for step in range(1, 9)] == [1.0] * 8
    assert not any(hook.drops(version) or hook.fails_allocation(version) for version in range(1, 9))
    assert hook.training_delay_s(3) == 0.0 and hook.generation_delay_s() == 0.0
    with pytest.raises(ConfigError, match=r"faults.inject.scale_lr.0.step"):
        validate_config(injected(small_config(tmp_path), scale_lr=[{"step": 0, "factor": 2}]))


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
def test_a_poisoned_step_is_dropped_and_a_spike_is_rolled_back_with_its_batch_skipped(ray_cluster, capfd, tmp_path):
    """Step 3's loss is NaN: its update is dropped (the learner leaves the weights alone) and the run goes on. Step
    6's loss is scaled a million times the first time it is trained: its gradient norm spikes against the median
    of the steps before, the learner and generators go back to the step-5 checkpoint, and step 6 is trained again on
    the next batch. Every step is logged once; the rollback is counted and kept in the checkpoints after it."""
    from grpo_dist.run.checkpoints import RUN_STATE_CLASSES
    from grpo_dist.storage import safe_load

    raw = health_run(tmp_path, 8, grad_norm={"factor": 1000.0, "action": "rollback"})
    raw = injected(raw, scale_loss=[{"step": 3, "factor": math.nan}, {"step": 6, "factor": 1e6, "once": True}])
    run_dir = tmp_path / "outputs" / "test"
    code, output = train_config_here(capfd, tmp_path, raw)
    assert code == 0, output[-3000:]
    assert "injecting faults (faults.inject): loss xnan at step 3; loss x1e+06 at step 6 once" in output
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
    assert health[0].startswith("health: step 3: non-finite values: loss") and health[0].endswith("dropped")
    assert health[1].startswith("health: step 6: a gradient spike: gradient norm") and health[1].endswith("back")
    assert health[2].startswith("health: rolled back to the checkpoint of step 5 in ")
    assert health[2].endswith(": the batches of step 6 skipped")
    assert all(torch.isfinite(tensor).all() for tensor in final_weights(run_dir).values())
    # `grpo-dist status` reads the same from the run's files as the run printed last.
    shown = cli_here(capfd, "status", str(run_dir))
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
def test_the_same_spike_after_a_rollback_stops_the_run_naming_its_check_step_and_figures(ray_cluster, capfd, tmp_path):
    """Without checkpoints, a rollback from step 2 goes back to the initial model (steps 1 and 2 trained again),
    where step 2 spikes again."""
    run_dir = tmp_path / "outputs" / "test"
    raw = health_run(tmp_path, 5, every_steps=0, grad_norm={"factor": 1000.0, "action": "rollback"})
    raw = injected(raw, scale_loss=[{"step": 2, "factor": 1e6}])  # every time step 2 is trained
    code, output = train_config_here(capfd, tmp_path, raw)
    assert code == 1, output[-3000:]
    assert [row["step"] for row in rows(run_dir)] == [1]
    rolled = "health: rolled back to the initial model (step 0: no checkpoint yet) in "
    assert rolled in output and "the batches of steps 1-2 (2 steps undone) skipped" in output
    assert len(re.findall(r"^step +1/5 ", output, re.M)) == 2  # trained again from the initial model
    stop = next(line for line in output.splitlines() if "the same cause twice" in line)
    assert "step 2: a gradient spike: gradient norm" in stop and "(health.grad_norm)" in stop, stop
    assert (run_dir / "interrupted").is_dir()
    print(stop)
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 1


@pytest.mark.slow
def test_a_spike_injected_once_is_met_once_across_a_rollback_to_the_initial_model(ray_cluster, capfd, tmp_path):
    """The same run with step 2's spike injected `once`: the rollback to the initial model rebuilds the learner's
    engine in its process, and step 2, trained again, is healthy; the run trains all its steps."""
    run_dir = tmp_path / "outputs" / "test"
    raw = health_run(tmp_path, 4, every_steps=0, grad_norm={"factor": 1000.0, "action": "rollback"})
    raw = injected(raw, scale_loss=[{"step": 2, "factor": 1e6, "once": True}])
    code, output = train_config_here(capfd, tmp_path, raw)
    assert code == 0, output[-3000:]
    assert "health: rolled back to the initial model (step 0: no checkpoint yet)" in output
    assert len(re.findall(r"^step +2/4 ", output, re.M)) == 1  # the spiking step 2 never logged, the healthy one once
    logged = rows(run_dir)
    assert [row["step"] for row in logged] == [1, 2, 3, 4]
    assert logged[-1]["faults/rollbacks"] == 1.0


@pytest.mark.slow
def test_each_other_check_catches_its_injected_cause_at_the_step_it_shows(ray_cluster, capfd, tmp_path):
    """One run, every check warning only, each cause injected at its own step:
    - the engines serve the initial weights labelled as version 2 (`faults.inject.drop_weights`, the sync check off):
      the batch of step 3 is sampled by other weights than the learner's, the log-prob gap check fires at step 3;
    - the reward's flag file is removed once step 3 is logged: the mean reward collapses a step or two later;
    - step 6 is trained at 300 times the learning rate (`faults.inject.scale_lr`): its update wrecks the weights, and
      step 7's KL to the reference and entropy show it."""
    flag = tmp_path / "reward-on"
    flag.write_text("")
    warn = {"action": "warn"}
    raw = health_run(
        tmp_path, 8, every_steps=0, grad_norm=warn, kl={**warn, "max": 1.0}, logprob_gap={**warn, "max": 1e-3},
        entropy={**warn, "fraction": 0.5}, reward={**warn, "fraction": 0.5},
    )  # fmt: skip
    raw["sync"] = {"probe": False}  # the sync check would catch the dropped weights first and send them again
    raw = injected(raw, drop_weights=[{"version": 2, "once": True}], scale_lr=[{"step": 6, "factor": 300}])
    raw["reward"]["sandbox"] = False  # the flag file is outside what a sandbox sees
    raw["reward"]["functions"].append({"name": "reward_fixtures.flag_reward", "weight": 1.0,
                                       "kwargs": {"path": str(flag)}})  # fmt: skip
    run_dir = tmp_path / "outputs" / "test"
    ended = threading.Event()
    remover = threading.Thread(target=unlink_after_step, args=(flag, run_dir, 3, ended), daemon=True)
    remover.start()
    try:
        code, output = train_config_here(capfd, tmp_path, raw)
    finally:
        ended.set()
        remover.join(timeout=5)
    assert code == 0, output[-3000:]
    assert not flag.exists()  # removed while the run went on
    health = [line for line in output.splitlines() if line.startswith("health: ")]
    print("\n".join(health))
    fired = {(int(line.split()[2].rstrip(":")), line.split("(health.")[1].split(")")[0]) for line in health}
    assert (3, "logprob_gap") in fired
    assert any(check == "reward" and step in (4, 5) for step, check in fired), fired
    assert {(7, "kl"), (7, "entropy")} <= fired, fired
    assert all(line.endswith(": a warning") for line in health)
    assert [row["step"] for row in rows(run_dir)] == list(range(1, 9))


def unlink_after_step(path: Path, run_dir: Path, step: int, ended: threading.Event) -> None:
    """Remove `path` once the run in `run_dir` has logged `step`, unless it `ended` first."""
    while not ended.is_set():
        if any(row["step"] >= step for row in rows_so_far(run_dir)):
            path.unlink()
            return
        time.sleep(0.05)


def rows_so_far(run_dir) -> list[dict]:
    try:
        return rows(run_dir)
    except (FileNotFoundError, json.JSONDecodeError):
        return []
