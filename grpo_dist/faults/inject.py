"""Faults injected on purpose (`faults.inject`): how a run rehearses what it does when its loss is poisoned, its
learning rate spikes, an engine serves other weights than it was sent, a step slows down or runs out of memory, or
generation slows. Off unless the config lists one; each actor builds an `Injector` from the run's section once (at
its start, and again when a run is handed to it) and meets it at named points of its work. A run that injects any
says so when it starts (`describe`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from grpo_dist.config import InjectConfig, StepFactor

ONCE = {True: " once", False: ""}


def describe(inject: InjectConfig) -> str | None:
    """One line naming every fault `inject` asks for (None when it asks for none)."""
    scaled = (("loss", inject.scale_loss), ("learning rate", inject.scale_lr))
    found = [
        f"{kind} x{each.factor:g} at step {each.step}{ONCE[each.once]}" for kind, listed in scaled for each in listed
    ]
    found += [f"the engines drop weight version {each.version}{ONCE[each.once]}" for each in inject.drop_weights]
    if inject.slow_training is not None:
        found.append(f"each micro-batch of step {inject.slow_training.step} held {inject.slow_training.seconds:g} s")
    if inject.fail_allocation_at_step is not None:
        found.append(f"an allocation fails in step {inject.fail_allocation_at_step}")
    if inject.slow_generation_file is not None:
        found.append(f"each group held back the seconds {inject.slow_generation_file} holds")
    return f"injecting faults (faults.inject): {'; '.join(found)}" if found else None


@dataclass
class Injector:
    """The faults of one run's `faults.inject`, as an actor meets them. Steps are training steps (the learner's
    weight version + 1 while it trains); weight versions are what a sync labels the weights it sends."""

    inject: InjectConfig = field(default_factory=InjectConfig)
    scaled: set[tuple[str, int]] = field(default_factory=set)  # (kind, step) scaled `once` already
    dropped: set[int] = field(default_factory=set)  # weight versions dropped already

    def _factor(self, kind: str, listed: list[StepFactor], step: int) -> float:
        for each in listed:
            if each.step == step and (kind, step) not in self.scaled:
                return each.factor
        return 1.0

    def loss_factor(self, step: int) -> float:
        """What the loss of each micro-batch of training step `step` is multiplied by (1: nothing injected)."""
        return self._factor("loss", self.inject.scale_loss, step)

    def lr_factor(self, step: int) -> float:
        """What the learning rate of training step `step`'s updates is multiplied by (put back after the step)."""
        return self._factor("lr", self.inject.scale_lr, step)

    def trained(self, step: int) -> None:
        """Training step `step` has ended: a factor listed `once` for it is not applied again (a step trained again
        after a rollback is then healthy)."""
        for kind, listed in (("loss", self.inject.scale_loss), ("lr", self.inject.scale_lr)):
            if any(each.step == step and each.once for each in listed):
                self.scaled.add((kind, step))

    def fails_allocation(self, step: int) -> bool:
        """Whether training step `step` asks for more memory than any machine has (a real allocation failure in a
        real step, every time the step is trained)."""
        return self.inject.fail_allocation_at_step == step

    def training_delay_s(self, step: int) -> float:
        """How long each micro-batch of training step `step` is held after its backward pass, as a machine shared
        with other work would slow it (the step still makes progress at every micro-batch)."""
        slow = self.inject.slow_training
        return slow.seconds if slow is not None and slow.step == step else 0.0

    def drops(self, version: int) -> bool:
        """Whether an engine that loaded weight `version` puts the initial model's weights back (still labelled
        `version`: an engine that silently serves other weights than it was sent, as one that dropped an adapter)."""
        for each in self.inject.drop_weights:
            if each.version == version and not (each.once and version in self.dropped):
                self.dropped.add(version)
                return True
        return False

    def generation_delay_s(self) -> float:
        """How long a generator holds each sampled group back now: the number of seconds the file
        `slow_generation_file` holds (none, 0, or no file: no delay), read at every group so that the generators'
        speed can change while the run goes."""
        path = self.inject.slow_generation_file
        try:
            return float(Path(path).read_text().strip() or 0) if path else 0.0
        except (OSError, ValueError):
            return 0.0
