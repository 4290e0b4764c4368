"""Generators that follow the bottleneck (`rollout.autoscale`): after each step, how long the learner waited on
generation against how long the generators waited on the learner, as shares of the step. One ahead of the other by
`band` for `patience` steps in a row calls for a generator more (the learner waits) or less (the generators wait),
within [`min`, `max`]; the count is held while a generator asked for is still joining, and for `patience` steps
after each change, so that it does not flap. The driver carries the change out as it does `grpo-dist scale`."""

from __future__ import annotations

from dataclasses import dataclass

from grpo_dist.config import AutoscaleConfig


@dataclass
class Change:
    """A change of the generator count, and why, in words."""

    wanted: int
    why: str


class Autoscaler:
    def __init__(self, cfg: AutoscaleConfig | None) -> None:
        self.cfg = cfg
        self.leaning = 0  # +1: the learner waits; -1: the generators wait; 0: neither by `band`
        self.streak = 0  # steps in a row leaning the same way since the last change

    def observe(self, metrics: dict[str, float]) -> Change | None:
        """A step's metrics (`time/step`, `time/learner_idle`, `time/generator_idle`, `generators/count`,
        `generators/joining`); the change they call for, if any."""
        cfg = self.cfg
        if cfg is None or metrics.get("time/step", 0.0) <= 0:
            return None
        if metrics.get("generators/joining", 0.0) > 0:  # a change under way: judge what it brings, once it joins
            self.leaning, self.streak = 0, 0
            return None
        step = metrics["time/step"]
        learner_waits = metrics.get("time/learner_idle", 0.0) / step
        generators_wait = metrics.get("time/generator_idle", 0.0) / step
        lean = learner_waits - generators_wait
        leaning = 1 if lean > cfg.band else -1 if lean < -cfg.band else 0
        self.streak = self.streak + 1 if leaning == self.leaning else 1
        self.leaning = leaning
        count = int(metrics.get("generators/count", cfg.min))
        wanted = min(cfg.max, max(cfg.min, count + leaning))
        if leaning == 0 or self.streak < cfg.patience or wanted == count:
            return None
        self.leaning, self.streak = 0, 0  # the next change waits `patience` steps again
        waited = (
            f"the learner waited {learner_waits:.0%} of the step on generation, the generators {generators_wait:.0%} "
            f"on the learner, {cfg.patience} steps in a row (rollout.autoscale.band {cfg.band:g})"
        )
        return Change(wanted, waited)
