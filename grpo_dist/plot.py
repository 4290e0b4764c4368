"""Reward curve of a run, drawn from its metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path


def plot_rewards(metrics_path: str | Path, out_path: str | Path, window: int = 10) -> Path:
    """Mean reward per step and its moving average over `window` steps, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    steps = [row["step"] for row in rows]
    rewards = [row["reward/mean"] for row in rows]
    smooth = [sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(steps, rewards, alpha=0.35, label="mean reward")
    axes.plot(steps, smooth, label=f"moving average ({window} steps)")
    axes.set_xlabel("step")
    axes.set_ylabel("reward")
    axes.set_ylim(0, 1)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    out_path = Path(out_path)
    figure.savefig(out_path, dpi=120)
    plt.close(figure)
    return out_path
