"""Faults a run survives: every remote call bounded, each actor's health as explicit state, replacements counted.

Every wait on actors, anywhere in the run, is `gather(refs, bound)`: a `Bound` names the phase it bounds and the
config key that sets it (`Bounds.of(cfg)` holds one per phase), and the outcome of each call says whether it
returned, its actor died (`RayActorError`), it gave no answer within the bound, or the actor's own code raised. The
first two are faults; the last is a bug, which the caller raises as such. Each caller decides what a fault means
for its role (a learner rank lost, a generator replaced, a weight sync failed). The pools
(`grpo_dist.generator_pool`, `grpo_dist.reward_pool`) keep their actors in an `ActorPool`: a faulty actor is killed
and a new one started in its place (same placement bundle), printed once and counted in `FaultLog`, whose totals go
to the metrics as `faults/*`.
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


@dataclass(frozen=True)
class Bound:
    """The longest a wait on actors lasts, and the config key that sets it (named in every error). Each phase of a
    run has its own, a field of `Bounds`."""

    seconds: float
    setting: str = ""  # the config key; empty for a fixed bound

    def __str__(self) -> str:
        return f"{self.seconds:g} s" + (f" ({self.setting})" if self.setting else "")


POLL = Bound(0.0)
"""No wait: what has finished by now."""
PROBE_TIMEOUT_S = 30.0  # an idle actor answers a probe at once


@dataclass(frozen=True)
class Bounds:
    """Every phase's bound, from the config: the one place a wait on actors takes its timeout from."""

    start: Bound  # an actor's constructor, an engine's start
    generate: Bound  # a generator without an answer while it has requests under way
    score: Bound  # a reward worker's share of a batch
    train: Bound  # a learner call (a training step, a checkpoint, a collective)
    sync: Bound  # a weight sync's calls on the generators
    placement: Bound  # the run's placement groups
    probe: Bound = Bound(PROBE_TIMEOUT_S)  # an idle actor asked whether it is alive

    @classmethod
    def of(cls, cfg) -> Bounds:
        faults = cfg.faults
        return cls(
            start=Bound(faults.start_timeout_s, "faults.start_timeout_s"),
            generate=Bound(faults.generate_timeout_s, "faults.generate_timeout_s"),
            score=Bound(faults.score_timeout_s, "faults.score_timeout_s"),
            train=Bound(cfg.sync.timeout_s, "sync.timeout_s"),
            sync=Bound(cfg.sync.timeout_s, "sync.timeout_s"),
            placement=Bound(cfg.ray.placement_timeout_s, "ray.placement_timeout_s"),
        )


@dataclass
class Outcome:
    """What one bounded remote call gave: its value, or why there is none."""

    value: Any = None
    fault: str | None = None  # "died (...)", or "gave no answer within N s": the actor, not its code, failed
    error: BaseException | None = None  # the exception: the actor's death, or one its own code raised
    pending: bool = False  # not finished when the wait ended (a fault unless the wait was a poll)

    @property
    def ok(self) -> bool:
        return self.fault is None and self.error is None

    @property
    def raised(self) -> bool:
        """Whether the actor's own code raised (a bug, raised as such), as opposed to the actor dying or hanging."""
        return self.error is not None and self.fault is None


def gather(refs: list[ray.ObjectRef], bound: Bound, count: int | None = None, fetch: bool = True) -> list[Outcome]:
    """Wait until `count` of the calls (default: all) have finished or `bound` has passed; one outcome per call, in
    order, for every call finished by then (a call still pending is `pending`, with its fault named by the bound).
    Nothing is raised: the caller decides. `fetch=False` leaves a finished value where it is (a reference passed
    on to other actors)."""
    done: set[ray.ObjectRef] = set()
    if refs:
        wanted = len(refs) if count is None else min(count, len(refs))
        done = set(ray.wait(refs, num_returns=wanted, timeout=bound.seconds, fetch_local=fetch)[0])
        if len(done) < len(refs) and wanted < len(refs):  # the first `count` came: take the others finished by now
            done = set(ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=fetch)[0])
    outcomes = []
    for ref in refs:
        if ref not in done:
            outcomes.append(Outcome(fault=f"gave no answer within {bound}", pending=True))
        elif not fetch:
            outcomes.append(Outcome(value=ref))
        else:
            try:
                outcomes.append(Outcome(value=ray.get(ref)))
            except ray.exceptions.RayActorError as err:
                outcomes.append(Outcome(fault=f"died ({first_line(err)})", error=err))
            except ray.exceptions.RayError as err:
                outcomes.append(Outcome(error=err))
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
        start_bound: Bound,
        ready_call: str = "__ray_ready__",
    ) -> None:
        self.role, self.counter, self.start_actor, self.faults = role, counter, start_actor, faults
        self.ready_call = ready_call
        self.max_restarts, self.start_bound = max_restarts, start_bound
        self.actors = [start_actor(slot) for slot in range(size)]
        self.health = [Health.STARTING] * size
        self.restarts = 0

    def name(self, slot: int) -> str:
        return f"{self.role} {slot}"

    def wait_ready(self, slots: list[int] | None = None) -> None:
        """Wait for the actors to be up (engines loading their models); fail naming the first that failed or hung."""
        slots = list(range(len(self.actors))) if slots is None else slots
        refs = [getattr(self.actors[slot], self.ready_call).remote() for slot in slots]
        for slot, outcome in zip(slots, gather(refs, self.start_bound), strict=True):
            if outcome.pending:
                self.health[slot] = Health.FAILED
                raise RunFailed(
                    f"{self.name(slot)} did not start within {self.start_bound}: its placement bundle may be waiting "
                    "for room on a live node (see `ray status`), or its engine is slow to load"
                )
            if not outcome.ok:
                self.health[slot] = Health.FAILED
                raise RunFailed(f"{self.name(slot)} failed to start: {first_line(outcome.error)}") from outcome.error
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

    def call(self, method: str, args: dict[int, tuple], bound: Bound) -> dict[int, Outcome]:
        """`method(*args[slot])` on each given slot at once; the outcome of each (an error of the actor's own code is
        raised: it is a bug, not a fault)."""
        slots = list(args)
        refs = [getattr(self.actors[slot], method).remote(*args[slot]) for slot in slots]
        outcomes = gather(refs, bound)
        for outcome in outcomes:
            if outcome.raised:
                raise outcome.error
        return dict(zip(slots, outcomes, strict=True))

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
