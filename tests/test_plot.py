"""The reward curve and the first/last-10-step summary that `make demo` prints, from a metrics.jsonl."""

from __future__ import annotations

import json

from grpo_dist.ops.plot import eval_curves, moving_average, plot_rewards, plot_run, reward_summary, step_rewards


def test_summary_and_curve_from_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rewards = [0.1] * 10 + [None] + [0.5] * 5 + [0.7] * 10  # step 11 logged no reward (NaN is written as null)
    metrics.write_text("".join(json.dumps({"step": i + 1, "reward/mean": r}) + "\n" for i, r in enumerate(rewards)))
    steps, kept = step_rewards(metrics)
    assert len(kept) == 25 and 11 not in steps
    # first 10 rewards are all 0.1, last 10 all 0.7: +0.6.
    assert reward_summary(kept) == "mean reward: first 10 steps 0.100, last 10 steps 0.700 (+0.600)"
    png = plot_rewards(steps, kept, tmp_path / "curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_moving_average_uses_fewer_values_at_the_start():
    # window 2: [1], [1, 3], [3, 5] -> 1, 2, 4
    assert moving_average([1.0, 3.0, 5.0], window=2) == [1.0, 2.0, 4.0]


def test_a_runs_picture_holds_its_eval_curves_phases_and_staleness(tmp_path):
    metrics, evaluations = tmp_path / "metrics.jsonl", tmp_path / "eval.jsonl"
    metrics.write_text("".join(
        json.dumps({"step": step, "reward/mean": 0.1 * step, "time/generate": 1.0, "time/train": 2.0,
                    "staleness/mean": 0.5, "staleness/max": 1}) + "\n"
        for step in range(1, 5)
    ))  # fmt: skip
    evaluations.write_text("".join(
        json.dumps({"step": step, "eval/sampled/accuracy": 0.2 * step, "eval/sampled/pass@1": 0.2 * step,
                    "eval/sampled/pass@4": 0.5, "eval/sampled/maj@4": 0.3, "eval/sampled/length_mean": 2.0}) + "\n"
        for step in (0, 2, 4)
    ))  # fmt: skip
    curves = eval_curves(evaluations)
    # the curves drawn: accuracy, pass@ and maj@ of each set; lengths are not a curve of the panel
    assert set(curves) == {"eval/sampled/accuracy", "eval/sampled/pass@1", "eval/sampled/pass@4", "eval/sampled/maj@4"}
    assert curves["eval/sampled/accuracy"] == ([0, 2, 4], [0.0, 0.4, 0.8])
    png = plot_run(metrics, tmp_path / "run.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
