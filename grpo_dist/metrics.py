"""Per-step metrics: what a rollout batch looked like, and where they go (console, metrics.jsonl, W&B)."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from grpo_dist.config import Config
from grpo_dist.types import Completion, Score


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """mean/std/min/max of the finite entries (NaN when none)."""
    values = values[torch.isfinite(values)]
    if values.numel() == 0:
        return {f"{prefix}/{name}": math.nan for name in ("mean", "std", "min", "max")}
    std = values.std(unbiased=False) if values.numel() > 1 else torch.tensor(0.0)
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/std": std.item(),
        f"{prefix}/min": values.min().item(),
        f"{prefix}/max": values.max().item(),
    }


def rollout_metrics(
    completions: list[Completion], scores: list[Score], advantages: torch.Tensor, reward_names: list[str]
) -> dict[str, float]:
    """Reward, per-function reward, advantage and length statistics of one rollout batch."""
    totals = torch.tensor([score.total for score in scores])  # [B]
    per_function = torch.tensor([score.per_function for score in scores])  # [B, F]
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float)  # [B]
    metrics = {**_stats("reward", totals), **_stats("advantage", advantages), **_stats("response_length", lengths)}
    for column, name in enumerate(reward_names):
        metrics[f"reward/{name}"] = _stats("r", per_function[:, column])["r/mean"]
    metrics["reward/unscored"] = float((~torch.isfinite(totals)).sum())
    metrics["response_length/clipped_fraction"] = sum(c.finish_reason == "length" for c in completions) / len(
        completions
    )
    metrics["tokens/generated"] = float(lengths.sum())
    metrics["rollout/weight_version"] = float(min(c.weight_version for c in completions))
    return metrics


log = logging.getLogger("grpo_dist")


class MetricsSink:
    """Writes one JSON object per step to `metrics.jsonl` (flushed every step) and mirrors it to W&B."""

    def __init__(
        self, run_dir: Path, wandb_run: Any | None, after_step: int = 0, finish_timeout_s: float = 120.0
    ) -> None:
        """`after_step`: a resumed run's last checkpointed step; rows after it (steps done again) are dropped.
        `finish_timeout_s`: the longest `close` waits for W&B to finish (`wandb.finish_timeout_s`)."""
        self.path = run_dir / "metrics.jsonl"
        if after_step and self.path.exists():
            self._keep_until(after_step)
        self.file = self.path.open("a")
        self.wandb_run = wandb_run
        self.finish_timeout_s = finish_timeout_s

    def rewind(self, step: int) -> None:
        """Drop the rows after `step`: the run goes back to it (a learner group restarted from a checkpoint)."""
        self.file.close()
        self._keep_until(step)
        self.file = self.path.open("a")

    def _keep_until(self, step: int) -> None:
        rows = self.path.read_text().splitlines()
        self.path.write_text("".join(row + "\n" for row in rows if json.loads(row)["step"] <= step))

    @property
    def wandb_id(self) -> str | None:
        return None if self.wandb_run is None else self.wandb_run.id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{key: _json_number(value) for key, value in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)

    def close(self) -> None:
        """Idempotent: the driver closes the sink after training and again on the way out."""
        self.file.close()
        if self.wandb_run is not None:
            run, self.wandb_run = self.wandb_run, None
            finishing = threading.Thread(target=run.finish, name="wandb-finish", daemon=True)
            finishing.start()
            finishing.join(self.finish_timeout_s)
            if finishing.is_alive():  # a network that hangs must not hold the run's end (its processes, its exit)
                log.warning(
                    "W&B did not finish within %g s (wandb.finish_timeout_s); its files stay in %s (`wandb sync` "
                    "uploads them)", self.finish_timeout_s, self.path.parent / "wandb",
                )  # fmt: skip


def _json_number(value: float) -> float | None:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def start_wandb(cfg: Config, run_dir: Path, run_id: str | None = None) -> Any | None:
    """A W&B run (offline into the run directory when no API key is set), or None when disabled; `run_id`
    continues that run (a resumed one)."""
    mode = cfg.wandb.mode
    if mode == "auto":
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    if not cfg.wandb.enabled or mode == "disabled":
        return None
    import wandb

    return wandb.init(
        project=cfg.wandb.project,
        name=cfg.wandb.run_name or cfg.run.name,
        config=cfg.model_dump(mode="json"),
        dir=str(run_dir),
        mode=mode,
        id=run_id,
        resume="allow" if run_id else None,
        settings=wandb.Settings(silent=True),
    )


class StepTimer:
    """Wall time of named phases of a step: `with timer("generate"): ...` -> {"time/generate": seconds}.
    A phase entered several times (dynamic sampling's rounds) adds up."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            key = f"time/{phase}"
            self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - started
