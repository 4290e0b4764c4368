"""The divergence guard: after every training step, checks on what the step measured, and the action each calls for.

A check looks at one step's metrics against a bound (`health.kl.max`) or against the run's recent history (the
median of the last `health.window` steps' gradient norms, entropies, rewards). What it finds is an `Event` naming
the check, the step, what it means (a diagnosis: divergence, a reward collapse, ...), the figures and the action
the config gives it (`health.<check>.action`); the driver carries the action out (`grpo_dist.run.recovery.judge_step`).

The defaults were chosen from `benchmarks/guard.py`, which runs every shipped CPU recipe and an injected cause for
each check: silent on the healthy runs, each cause caught within three steps and named. Three lessons shaped them:
- In GRPO the gradient norm jumps when a group first gets signal, the moment the policy starts to learn (up to 26x
  its median in the quick start), and clipping at `learner.max_grad_norm` already bounds what such a step does: a spike
  alone warns, and only three orders of magnitude count as one.
- A policy that diverges shows it at once: its entropy falls to near zero in one update (at learning rate 50 from
  2.69 to 0 at the second step). The entropy and gradient-norm checks therefore judge from the run's second step,
  against whatever history there is; only the reward, noisy while it is small, waits for `health.min_history`.
- A policy already sharp sharpens fast when it learns: the warmed-up agent demo's entropy goes from 0.6 to 0.1 nats
  in 9 healthy steps. The entropy check also wants a fall of `health.entropy.min_fall` nats, so under it a collapse
  is left to the reward and KL checks.
- A policy that collapses onto what scores is converging, not diverging: the tests' tiny config, at reward 0.9 (its
  best), goes from 1.95 to 0 nats in one step and stays there, its reward held. A divergence costs reward at once
  (learning rate 50: 0.098 to 0; one update at 300x: 0.134 to 0.104). So the entropy check also wants the step's
  mean reward down: under the window's median for the `fraction` bound, under each of the last 3 steps' for the
  `sudden` one (judged against the lowest of their entropies: a fall that continues a trend is not a break).

A figure that fires its check does not join that check's history: the baseline stays the healthy one, and a
collapse that persists keeps being reported.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from grpo_dist.config import HealthConfig

SEVERITY = {"off": 0, "warn": 1, "skip": 2, "rollback": 3, "stop": 4}
"""When several checks fire at one step, the most severe action is taken."""
HISTORIES = {"grad_norm": "grad_norm", "entropy": "entropy", "reward": "reward/mean"}
"""The checks judged against the run's recent history, and the metric each keeps."""
RECENT = 3
"""Steps in the median the entropy's sudden fall (`health.entropy.sudden`) is judged against."""
FROM_FIRST_STEP = ("grad_norm", "entropy")
"""The history checks that judge from the run's second step on (one step of history); the reward waits for
`health.min_history`."""
DIAGNOSES = {
    "nonfinite": "non-finite values",
    "grad_norm": "a gradient spike",
    "kl": "divergence from the reference",
    "logprob_gap": "engines and learner apart",
    "entropy": "divergence (entropy collapse)",
    "reward": "reward collapse",
}
"""What each check's firing means, named first in every line it prints."""
COUNTED = {"warn": "warnings", "skip": "skipped", "rollback": "rollbacks"}
"""Each counted action, and its `health/*` counter."""
COUNTS = tuple(COUNTED.values())


@dataclass
class Event:
    """One check that fired at one step."""

    step: int
    check: str  # nonfinite, grad_norm, kl, logprob_gap, entropy, reward
    action: str  # warn, skip, rollback, stop
    figures: str  # what was measured against what, in words

    def __str__(self) -> str:
        return f"step {self.step}: {self.what()}"

    def what(self) -> str:
        return f"{DIAGNOSES[self.check]}: {self.figures} (health.{self.check})"


class Guard:
    """The checks of `health` and the history they judge against. `check(step, metrics)` returns the step's events
    (empty: healthy); `record(metrics, events)` adds a step that stands to the history."""

    def __init__(self, cfg: HealthConfig, clip: float = 0.0) -> None:
        self.cfg = cfg
        self.clip = clip  # `learner.max_grad_norm`: a norm under it moves the weights as a usual step does
        self.history: dict[str, list[float]] = {check: [] for check in HISTORIES}
        self.counts = dict.fromkeys(COUNTS, 0)
        self.rolled_back_from: list[tuple[str, int]] = []  # (check, step) of each rollback: the same again stops

    def check(self, step: int, metrics: dict[str, float]) -> list[Event]:
        """The checks that fire on step `step`'s metrics, most severe first."""
        events = [event for event in self._events(step, metrics) if event.action != "off"]
        return sorted(events, key=lambda event: -SEVERITY[event.action])

    def _events(self, step: int, metrics: dict[str, float]):
        cfg = self.cfg
        loss, grad_norm = metrics.get("loss", 0.0), metrics.get("grad_norm", 0.0)
        if not math.isfinite(loss) or not math.isfinite(grad_norm) or metrics.get("learner/skipped", 0.0) > 0:
            yield Event(step, "nonfinite", cfg.nonfinite.action, f"loss {loss:.4g}, gradient norm {grad_norm:.4g}")
            return  # the other figures of a step without an update mean nothing
        median = self.median("grad_norm")
        if median is not None and grad_norm > max(cfg.grad_norm.factor * median, self.clip):
            figures = self._against("grad_norm", "gradient norm", grad_norm, median, f"{cfg.grad_norm.factor:g}x")
            yield Event(step, "grad_norm", cfg.grad_norm.action, figures)
        if (kl := metrics.get("kl")) is not None and kl > cfg.kl.max:
            yield Event(step, "kl", cfg.kl.action, f"KL to the reference {kl:.4g} > {cfg.kl.max:g}")
        fresh = metrics.get("staleness/max", 0.0) == 0  # a stale batch's gap is the policy's own move since then
        if (gap := metrics.get("logprob_gap")) is not None and fresh and gap > cfg.logprob_gap.max:
            figures = f"learner/engine log-prob gap {gap:.4g} per token > {cfg.logprob_gap.max:g}"
            yield Event(step, "logprob_gap", cfg.logprob_gap.action, figures)
        yield from self._collapses(step, metrics)

    def _collapses(self, step: int, metrics: dict[str, float]):
        """The entropy's collapse (`_entropy_collapse`); the reward against the median of the window's."""
        yield from self._entropy_collapse(step, metrics)
        reward, median = metrics.get(HISTORIES["reward"]), self.median("reward")
        if reward is not None and median is not None and 0 < median and reward < self.cfg.reward.fraction * median:
            figures = self._against("reward", "mean reward", reward, median, f"{self.cfg.reward.fraction:g}x")
            yield Event(step, "reward", self.cfg.reward.action, figures)

    def _entropy_collapse(self, step: int, metrics: dict[str, float]):
        """The entropy under `fraction` of the window's median, at a step whose mean reward is under the window's
        median too; or under `sudden` of the lowest of the last `RECENT` steps' (a break, not a trend), at a step
        whose mean reward is under all of theirs. Either way by at least `min_fall` nats. A collapse with the
        reward held is a policy converging on what scores. A run without a reward figure is judged on the entropy
        alone. One event at most."""
        cfg, entropy = self.cfg.entropy, metrics.get(HISTORIES["entropy"])
        reward, rewards = metrics.get(HISTORIES["reward"]), self.history["reward"]
        if entropy is None or not self.history["entropy"]:
            return
        window = self.cfg.window
        for fraction, steps, baseline, reward_baseline, of in (
            (cfg.fraction, window, statistics.median, statistics.median, "a median"),
            (cfg.sudden, RECENT, min, min, "a low"),
        ):  # fmt: skip
            level = baseline(self.history["entropy"][-steps:])
            if not (0 < level and level - entropy >= cfg.min_fall and entropy < fraction * level):
                continue
            lost = ""
            if reward is not None and rewards:
                held = reward_baseline(rewards[-steps:])
                if reward >= held:
                    continue
                lost = f", mean reward {reward:.4g} against {of} of {held:.4g}"
            figures = self._against("entropy", "entropy", entropy, level, f"{fraction:g}x", steps, of) + lost
            yield Event(step, "entropy", cfg.action, figures)
            return

    def median(self, check: str, window: int | None = None) -> float | None:
        """The median of the check's last `window` values (default `health.window`), once there are enough."""
        values = self.history[check][-(window or self.cfg.window) :]
        enough = 1 if check in FROM_FIRST_STEP else self.cfg.min_history
        return statistics.median(values) if len(values) >= enough else None

    def _against(
        self, check: str, name: str, value: float, level: float, bound: str, window: int = 0, of: str = "a median"
    ) -> str:
        steps = min(len(self.history[check]), window or self.cfg.window)
        over = "the last step" if steps == 1 else f"the last {steps} steps"
        return f"{name} {value:.4g} against {of} of {level:.4g} over {over} (bound {bound})"

    def record(self, metrics: dict[str, float], events: list[Event] = ()) -> None:
        """A step that stands (logged): its figures join the history, when finite, except those of a check that
        fired on them (an unhealthy figure sets no baseline)."""
        fired = {event.check for event in events}
        if "entropy" in fired:  # the reward it lost is no baseline either: a collapse that persists keeps firing
            fired.add("reward")
        for check, key in HISTORIES.items():
            value = metrics.get(key)
            if check in fired or check == "grad_norm" and value == 0:  # a step without signal sets no baseline
                continue
            if value is not None and math.isfinite(value):
                self.history[check] = (self.history[check] + [value])[-self.cfg.window :]

    def count(self, action: str) -> None:
        self.counts[COUNTED[action]] += 1

    def again(self, event: Event) -> bool:
        """Whether a rollback for `event` would repeat one already made: the same check at the same step."""
        return (event.check, event.step) in self.rolled_back_from

    def rolled_back(self, event: Event, history: dict[str, list[float]] | None) -> None:
        """After a rollback for `event`: remembered, and the history back to what it was at the checkpoint."""
        self.rolled_back_from.append((event.check, event.step))
        self.counts["rollbacks"] += 1
        self.history = {check: list((history or {}).get(check, [])) for check in HISTORIES}

    def metrics(self) -> dict[str, float]:
        return {f"health/{key}": float(value) for key, value in self.counts.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "counts": self.counts, "rolled_back_from": self.rolled_back_from}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Back to a checkpoint's guard (none in a checkpoint from before the guard: a fresh one)."""
        state = state or {}
        self.history = {check: list(state.get("history", {}).get(check, [])) for check in HISTORIES}
        self.counts = {key: state.get("counts", {}).get(key, 0) for key in COUNTS}
        self.rolled_back_from = [tuple(item) for item in state.get("rolled_back_from", [])]
