"""Reward curve of a run, drawn from its metrics.jsonl, and the before/after summary `make demo` prints."""

from __future__ import annotations

import json
from pathlib import Path

from grpo_dist.config import ConfigError


def read_metrics(metrics_path: str | Path) -> list[dict]:
    rows = []
    for number, line in enumerate(Path(metrics_path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ConfigError(f"{metrics_path}:{number}: not a metrics row ({err.msg}); expected JSON Lines") from None
    return rows


def moving_average(values: list[float], window: int) -> list[float]:
    """Mean of the last `window` values at each position (fewer at the start)."""
    averages = []
    for end in range(1, len(values) + 1):
        recent = values[max(0, end - window) : end]
        averages.append(sum(recent) / len(recent))
    return averages


def step_rewards(metrics_path: str | Path) -> tuple[list[int], list[float]]:
    """(steps, mean reward) of every logged step that has a reward."""
    rows = [row for row in read_metrics(metrics_path) if row.get("reward/mean") is not None]
    return [row["step"] for row in rows], [row["reward/mean"] for row in rows]


def reward_summary(rewards: list[float], window: int = 10) -> str:
    """'mean reward: first 10 steps X, last 10 steps Y (+Z)'."""
    if not rewards:
        return "no steps logged"
    first = sum(rewards[:window]) / len(rewards[:window])
    last = sum(rewards[-window:]) / len(rewards[-window:])
    return f"mean reward: first {window} steps {first:.3f}, last {window} steps {last:.3f} ({last - first:+.3f})"


def plot_rewards(steps: list[int], rewards: list[float], out_path: str | Path, window: int = 10) -> Path:
    """Mean reward per step and its moving average over `window` steps, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(steps, rewards, alpha=0.35, label="mean reward")
    axes.plot(steps, moving_average(rewards, window), label=f"moving average ({window} steps)")
    axes.set_xlabel("step")
    axes.set_ylabel("reward")
    axes.set_ylim(0, 1)
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left")
    figure.tight_layout()
    out_path = Path(out_path)
    figure.savefig(out_path, dpi=120)
    plt.close(figure)
    return out_path
