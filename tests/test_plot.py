"""The reward curve and the first/last-10-step summary that `make demo` prints, from a metrics.jsonl."""

from __future__ import annotations

import json

from grpo_dist.plot import moving_average, plot_rewards, reward_summary, step_rewards


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
