"""Faults a run survives: every remote call bounded, each actor's health as explicit state, replacements counted.

A fault is detected in one place, `gather`: a call whose actor died (`RayActorError`) or that did not answer within
its bound is a fault; an exception raised by the actor's own code is not (it is a bug, and is raised as such). The
pools (`grpo_dist.generator_pool`, `grpo_dist.reward_pool`) keep their actors in an `ActorPool`: a faulty actor is
killed and a new one started in its place (same placement bundle), printed once and counted in `FaultLog`, whose
totals go to the metrics as `faults/*`.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
import torch
from tqdm import tqdm

log = logging.getLogger("grpo_dist")

START_ATTEMPTS = 5  # for a replacement whose actor dies while starting (placed on a node not yet known dead)
RETRY_PAUSE_S = 5.0
COUNTERS = ("generator_restarts", "reward_worker_restarts", "learner_restarts", "regenerated", "rescored", "unscored")
"""Every `faults/*` metric, logged from step 1 so that each has a curve."""


class Health(enum.Enum):
    """One actor slot's state."""

    STARTING = "starting"  # created, constructor not yet known to have finished
    HEALTHY = "healthy"
    RESTARTING = "restarting"  # killed after a fault; its replacement is starting
    FAILED = "failed"  # could not be replaced: the run stops


class RunFailed(RuntimeError):
    """A fault the run cannot survive (a role out of restarts, nothing to restart from); names what and why."""


@dataclass
class Outcome:
    """What one bounded remote call gave: its value, or why there is none."""

    value: Any = None
    fault: str | None = None  # "died: ..." or "no answer within N s"; None when the call returned


def gather(refs: list[ray.ObjectRef], timeout_s: float) -> list[Outcome]:
    """Wait at most `timeout_s` for all calls; one outcome per call, in order. An actor's own exception is raised."""
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    outcomes = []
    for ref in refs:
        if ref in pending:
            outcomes.append(Outcome(fault=f"gave no answer within {timeout_s:g} s"))
            continue
        try:
            outcomes.append(Outcome(value=ray.get(ref)))
        except ray.exceptions.RayActorError as err:
            outcomes.append(Outcome(fault=f"died ({first_line(err)})"))
    return outcomes


def first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0][:200] if lines else type(err).__name__


def split(total: int, parts: int) -> dict[int, tuple[int, int]]:
    """Slot -> [start, end): `total` items cut into `parts` near-equal contiguous shares (empty ones left out)."""
    bounds = torch.linspace(0, total, parts + 1).round().long().tolist()
    return {
        slot: (start, end) for slot, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)) if end > start
    }


class FaultLog:
    """Counts of what a run survived; each fault is printed once, as one line naming the actor and what was done."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()  # the generator pool and the scoring thread both count

    def record(self, counter: str, message: str, amount: int = 1) -> None:
        self.count(counter, amount)
        tqdm.write(f"fault: {message}")  # on a line of its own, under the progress bar

    def count(self, counter: str, amount: int = 1) -> None:
        with self.lock:
            self.counts[counter] += amount

    def metrics(self) -> dict[str, float]:
        return {f"faults/{name}": float(self.counts[name]) for name in COUNTERS}


class ActorPool:
    """The actors of one role in numbered slots. `start_actor(slot)` creates slot's actor (in its placement), and
    an actor is up once its `ready_call` method (by default: its constructor) has returned; `replace(slot, why)`
    kills it and waits, bounded, for a new one; past `max_restarts` the run fails."""

    def __init__(
        self,
        role: str,
        counter: str,
        start_actor: Callable[[int], ray.actor.ActorHandle],
        size: int,
        faults: FaultLog,
        max_restarts: int,
        start_timeout_s: float,
        ready_call: str = "__ray_ready__",
    ) -> None:
        self.role, self.counter, self.start_actor, self.faults = role, counter, start_actor, faults
        self.ready_call = ready_call
        self.max_restarts, self.start_timeout_s = max_restarts, start_timeout_s
        self.actors = [start_actor(slot) for slot in range(size)]
        self.health = [Health.STARTING] * size
        self.restarts = 0

    def name(self, slot: int) -> str:
        return f"{self.role} {slot}"

    def wait_ready(self, slots: list[int] | None = None) -> None:
        """Wait for the actors to be up (engines loading their models); fail naming the first that failed or hung."""
        slots = list(range(len(self.actors))) if slots is None else slots
        refs = [getattr(self.actors[slot], self.ready_call).remote() for slot in slots]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=self.start_timeout_s)
        for slot, ref in zip(slots, refs, strict=True):
            if ref in pending:
                self.health[slot] = Health.FAILED
                raise RunFailed(
                    f"{self.name(slot)} did not start within {self.start_timeout_s:g} s (faults.start_timeout_s): "
                    "its placement bundle may be waiting for room on a live node (see `ray status`), or its engine "
                    "is slow to load"
                )
            try:
                ray.get(ref)
            except ray.exceptions.RayError as err:
                self.health[slot] = Health.FAILED
                raise RunFailed(f"{self.name(slot)} failed to start: {first_line(err)}") from err
            self.health[slot] = Health.HEALTHY

    def replace(self, slot: int, why: str, then: str = "") -> None:
        """Kill slot's actor (whatever state it is in) and start a new one in its place; `why` and `then` (what
        the caller does next) go into the printed line."""
        self.health[slot] = Health.RESTARTING
        if self.restarts >= self.max_restarts:
            self.health[slot] = Health.FAILED
            raise RunFailed(f"{self.name(slot)} {why}; the run is out of {self.role} restarts ({self.max_restarts})")
        self.restarts += 1
        started = time.monotonic()
        for attempt in range(1, START_ATTEMPTS + 1):
            ray.kill(self.actors[slot], no_restart=True)
            self.actors[slot] = self.start_actor(slot)
            try:
                self.wait_ready([slot])
                break
            except RunFailed as err:
                if attempt == START_ATTEMPTS or not isinstance(err.__cause__, ray.exceptions.RayActorError):
                    raise
                # Placed where the lost actor was, on a node Ray has not yet declared dead: its placement
                # bundle moves to a live node once it has, so try again.
                log.warning("%s; starting it again (attempt %d of %d)", err, attempt + 1, START_ATTEMPTS)
                time.sleep(RETRY_PAUSE_S)
        took = time.monotonic() - started
        self.faults.record(self.counter, f"{self.name(slot)} {why}; replaced it in {took:.1f} s{then and '; ' + then}")

    def join(self, actor: ray.actor.ActorHandle) -> None:
        """Take an actor started elsewhere, and up, into a new last slot."""
        self.actors.append(actor)
        self.health.append(Health.HEALTHY)

    def remove_last(self) -> None:
        """Stop the actor of the last slot and drop the slot."""
        ray.kill(self.actors.pop(), no_restart=True)
        self.health.pop()

    def call(self, method: str, args: dict[int, tuple], timeout_s: float) -> dict[int, Outcome]:
        """`method(*args[slot])` on each given slot at once; the outcome of each."""
        slots = list(args)
        refs = [getattr(self.actors[slot], method).remote(*args[slot]) for slot in slots]
        return dict(zip(slots, gather(refs, timeout_s), strict=True))

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
