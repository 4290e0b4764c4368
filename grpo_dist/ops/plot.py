"""A run's picture, drawn from its metrics.jsonl (and the eval.jsonl beside it): the reward curve, each eval set's
curves, the time each phase of a step took, and staleness; and the first/last-10-step summary `make demo`
prints."""

from __future__ import annotations

from pathlib import Path

from grpo_dist.config import ConfigError
from grpo_dist.storage import jsonl


def read_metrics(metrics_path: str | Path) -> list[dict]:
    """The rows of a metrics file; a torn last line (a run still writing it, or one that crashed mid-write) is left
    out, any other line that is not a row is an error."""
    try:
        return jsonl.read_rows(Path(metrics_path), strict=True)
    except jsonl.BadLine as bad:
        raise ConfigError(f"{metrics_path}:{bad.number}: not a metrics row ({bad.why}); expected JSON Lines") from None


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


PHASES = ("generate", "reward", "train", "sync", "eval")  # time/<phase>, as the driver's step timer names them


def eval_curves(eval_path: str | Path) -> dict[str, tuple[list[int], list[float]]]:
    """{`eval/<set>/<metric>`: (steps, values)} for each set's accuracy and pass@k / maj@k, from an eval.jsonl."""
    curves: dict[str, tuple[list[int], list[float]]] = {}
    if not Path(eval_path).is_file():
        return curves
    for row in read_metrics(eval_path):
        for key, value in row.items():
            shown = key.endswith("/accuracy") or "/pass@" in key or "/maj@" in key
            if key.startswith("eval/") and shown and value is not None:
                steps, values = curves.setdefault(key, ([], []))
                steps.append(row["step"])
                values.append(value)
    return curves


def plot_run(metrics_path: str | Path, out_path: str | Path, window: int = 10) -> Path:
    """Four panels: mean reward and its moving average; each eval set's accuracy, highest pass@k and maj@k; the
    seconds each phase of a step took; the mean and highest staleness of the samples trained on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    figure, ((reward, evals), (times, stale)) = plt.subplots(2, 2, figsize=(12, 7))
    steps, rewards = step_rewards(metrics_path)
    reward.plot(steps, rewards, alpha=0.35, label="mean reward")
    reward.plot(steps, moving_average(rewards, window), label=f"moving average ({window} steps)")
    reward.set_title("reward")
    curves = eval_curves(Path(metrics_path).with_name("eval.jsonl"))  # each evaluation's row
    highest = {}  # per set, its largest k's pass@ and maj@ only
    for key in curves:
        name, _, metric = key.removeprefix("eval/").rpartition("/")
        kind, _, k = metric.partition("@")
        if k and int(k) >= highest.get((name, kind), (0, ""))[0]:
            highest[(name, kind)] = (int(k), key)
    for key in [key for key in curves if key.endswith("/accuracy")] + [key for _, key in highest.values()]:
        evals.plot(*curves[key], marker="o", label=key.removeprefix("eval/"))
    evals.set_title("evaluation" if curves else "evaluation (none logged: eval.jsonl)")
    evaluations = read_metrics(eval_path) if (eval_path := Path(metrics_path).with_name("eval.jsonl")).is_file() else []
    for phase in PHASES:
        timed = evaluations if phase == "eval" else rows  # an evaluation's time is in its own row
        points = [(row["step"], row[f"time/{phase}"]) for row in timed if row.get(f"time/{phase}") is not None]
        if points:
            sparse = len(points) < len(rows) / 2  # a phase of some steps only (eval): points, not a line
            times.plot(
                *zip(*points, strict=True),
                label=phase,
                marker="o" if sparse else None,
                linestyle="none" if sparse else "-",
            )
    times.set_title("seconds per step, by phase")
    for key in ("staleness/mean", "staleness/max"):
        points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
        if points:
            stale.plot(*zip(*points, strict=True), label=key.partition("/")[2])
    stale.set_title("staleness (weight versions behind the learner)")
    for axes in (reward, evals, times, stale):
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(loc="best", fontsize=8)
    figure.tight_layout()
    out_path = Path(out_path)
    figure.savefig(out_path, dpi=100)
    plt.close(figure)
    return out_path
