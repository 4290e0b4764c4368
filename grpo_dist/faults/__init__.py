"""Faults a run survives: every remote call bounded, each actor's health as explicit state, replacements counted.

Every wait on actors, anywhere in the run, is `gather(refs, bound)`: a `Bound` names the phase it bounds and the config
key that sets it (`Bounds.of(cfg)` holds one per phase), and the outcome of each call says whether it returned, its
actor died (`RayActorError`), it gave no answer within the bound, or the actor's own code raised. The first two are
faults, and so is an `ActorFault`, which an actor raises when its process lives but cannot work (its vLLM engine died,
its device failed or ran out of memory); any other error is a bug, which the caller raises as such. Each caller decides
what a fault means for its role (a learner rank lost, a generator replaced, a weight sync failed). The pools
(`grpo_dist.cluster.generator_pool`, `grpo_dist.cluster.reward_pool`) keep their actors in an `ActorPool`: a faulty
actor is killed and a new one started in its place (same placement bundle), printed once and counted in `FaultLog`,
whose totals go to the metrics as `faults/*`. Faults injected on purpose to rehearse all this (`faults.inject`) are
`grpo_dist.faults.inject`'s. Where a wait gives up on actors that live, their stacks go into the run directory
(`grpo_dist.faults.stacks`).

May import: `config` and `types` only.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray
from tqdm import tqdm

from grpo_dist.faults import stacks

log = logging.getLogger("grpo_dist")

START_ATTEMPTS = 5  # for a replacement whose actor dies while starting (placed on a node not yet known dead)
RETRY_PAUSE_S = 5.0
CLOSE_S = 15.0  # for an actor to end the processes it started (sandboxes, jails) before it is killed
COUNTERS = (
    "generator_restarts",
    "engine_restarts",
    "reward_worker_restarts",
    "learner_restarts",
    "judge_restarts",
    "reward_model_restarts",
    "teacher_restarts",
    "regenerated",
    "rescored",
    "unscored",
    "sync_mismatches",
    "rollbacks",
)
"""Every `faults/*` metric, logged from step 1 so that each has a curve."""


class Health(enum.Enum):
    """One actor slot's state."""

    STARTING = "starting"  # created, constructor not yet known to have finished
    HEALTHY = "healthy"
    RESTARTING = "restarting"  # killed after a fault; its replacement is starting
    FAILED = "failed"  # could not be replaced: the run stops


class RunFailed(RuntimeError):
    """A fault the run cannot survive (a role out of restarts, nothing to restart from); names what and why."""


class ActorFault(RuntimeError):
    """What an error from an actor whose process lives means when the actor can no longer do its work (`as_fault`
    reads it from the error; an actor may also raise it): `kind` is "engine died" (its vLLM engine core is gone),
    "out of memory" or "device error" (the accelerator failed: a CUDA, cuBLAS or NCCL error, an ECC fault).
    Callers treat it as the actor's death, not as a bug."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


DEVICE_ERRORS = (
    "CUDA error",
    "CUBLAS_STATUS",
    "cuDNN error",
    "NCCL error",
    "device-side assert",
    "illegal memory access",
    "ECC error",
    "CUDA driver",
)
"""Words in a RuntimeError that mean the device, not the code, failed (the state of the process is then lost)."""


def as_fault(err: BaseException) -> ActorFault | None:
    """The `ActorFault` an error from an engine or a device means, or None for any other error (a bug). Matched by
    class name and message, so that neither vLLM nor CUDA need be importable where this runs."""
    if isinstance(err, ActorFault):
        return err
    names = {cls.__name__ for cls in type(err).__mro__}
    detail = first_line(err)
    if "EngineDeadError" in names:
        return ActorFault("engine died", detail)
    if "OutOfMemoryError" in names or "out of memory" in str(err) or "can't allocate memory" in str(err):
        return ActorFault("out of memory", detail)
    if isinstance(err, RuntimeError) and any(words in str(err) for words in DEVICE_ERRORS):
        return ActorFault("device error", detail)
    return None


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
HEARTBEAT_S = 1.0  # how often a call bounded by its progress asks its actor how far it has got


@dataclass(frozen=True)
class Bounds:
    """Every phase's bound, from the config: the one place a wait on actors takes its timeout from."""

    start: Bound  # an actor's constructor, an engine's start
    generate: Bound  # a generator without an answer while it has requests under way
    score: Bound  # a reward worker without a completion scored while it scores (its heartbeat)
    train: Bound  # a learner rank without a micro-batch or optimizer step done in a training step (its heartbeat)
    checkpoint: Bound  # a learner call writing, moving or loading a checkpoint or a policy
    sync: Bound  # a weight sync's calls, on the learner ranks and on the generators
    placement: Bound  # the run's placement groups
    probe: Bound = Bound(PROBE_TIMEOUT_S)  # an idle actor asked whether it is alive
    stacks_dir: Path | None = None  # where the stacks of actors a wait gave up on go (`grpo_dist.faults.stacks`)

    @classmethod
    def of(cls, cfg) -> Bounds:
        faults = cfg.faults
        return cls(
            stacks_dir=cfg.run_dir / stacks.STALLS_DIR,
            start=Bound(faults.start_timeout_s, "faults.start_timeout_s"),
            generate=Bound(faults.generate_timeout_s, "faults.generate_timeout_s"),
            score=Bound(faults.score_timeout_s, "faults.score_timeout_s"),
            train=Bound(faults.train_timeout_s, "faults.train_timeout_s"),
            checkpoint=Bound(faults.checkpoint_timeout_s, "faults.checkpoint_timeout_s"),
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
    kind: str | None = None  # an `ActorFault`'s kind: the actor lives, its engine or device failed

    @property
    def ok(self) -> bool:
        return self.fault is None and self.error is None

    @property
    def raised(self) -> bool:
        """Whether the actor's own code raised (a bug, raised as such), as opposed to the actor dying or hanging."""
        return self.error is not None and self.fault is None


def gather(
    refs: list[ray.ObjectRef], bound: Bound, count: int | None = None, fetch: bool = True, fail_fast: bool = False
) -> list[Outcome]:
    """Wait until `count` of the calls (default: all) have finished or `bound` has passed; one outcome per call, in
    order, for every call finished by then (a call still pending is `pending`, with its fault named by the bound).
    Nothing is raised: the caller decides. `fetch=False` leaves a finished value where it is (a reference passed
    on to other actors). `fail_fast`: stop waiting as soon as one call has failed (the collectives of a group whose
    other members would wait on the failed one until the bound)."""
    done: set[ray.ObjectRef] = set()
    outcomes: dict[ray.ObjectRef, Outcome] = {}
    if refs:
        wanted = len(refs) if count is None else min(count, len(refs))
        deadline = time.monotonic() + bound.seconds
        while len(done) < wanted:
            remaining = [ref for ref in refs if ref not in done]
            timeout = max(0.0, deadline - time.monotonic())
            step = 1 if fail_fast else wanted - len(done)
            ready = ray.wait(remaining, num_returns=step, timeout=timeout, fetch_local=fetch)[0]
            done.update(ready)
            if fail_fast:
                outcomes.update((ref, _outcome(ref, fetch)) for ref in ready)
                if any(not outcomes[ref].ok for ref in ready):
                    break
            if not ready or time.monotonic() >= deadline:
                break
        if len(done) < len(refs):  # take the others finished by now
            done.update(
                ray.wait(
                    [ref for ref in refs if ref not in done],
                    num_returns=len(refs) - len(done),
                    timeout=0,
                    fetch_local=fetch,
                )[0]
            )
    for ref in refs:
        if ref not in outcomes:
            outcomes[ref] = (
                _outcome(ref, fetch) if ref in done else Outcome(fault=f"gave no answer within {bound}", pending=True)
            )
    return [outcomes[ref] for ref in refs]


def gather_progressing(
    refs: list[ray.ObjectRef], actors: list[ray.actor.ActorHandle], bound: Bound, fail_fast: bool = False
) -> list[Outcome]:
    """Like `gather`, with each call bounded by its progress rather than its length: every `HEARTBEAT_S` the actor
    of each unfinished call is asked its `progress()` (a count of the pieces of work it has finished, answered by
    a thread of its own), and a call whose count has not moved for `bound` (or whose actor does not answer) is
    given up, `pending`, as hung; the others are waited for (with `fail_fast`, not after a failure or a hang). A
    slow call that keeps making progress is waited for as long as it takes."""
    moved = [time.monotonic()] * len(refs)  # when each call's actor last showed progress
    counts: list[Any] = [None] * len(refs)
    finished: dict[int, Outcome] = {}  # fetched once, as each call finishes
    hung: set[int] = set()
    tick = Bound(min(HEARTBEAT_S, bound.seconds), bound.setting)
    while unfinished := [index for index in range(len(refs)) if index not in finished and index not in hung]:
        for index, outcome in zip(
            unfinished, gather([refs[i] for i in unfinished], tick, fail_fast=fail_fast), strict=True
        ):
            if not outcome.pending:
                finished[index] = outcome
        if fail_fast and (hung or any(not outcome.ok for outcome in finished.values())):
            break
        unfinished = [index for index in unfinished if index not in finished]
        beats = gather([actors[index].progress.remote() for index in unfinished], tick)
        now = time.monotonic()
        for index, beat in zip(unfinished, beats, strict=True):
            if beat.ok and beat.value != counts[index]:
                counts[index], moved[index] = beat.value, now
        hung.update(index for index in unfinished if now - moved[index] > bound.seconds)
    return [
        finished[index] if index in finished else Outcome(fault=f"made no progress for {bound}", pending=True)
        for index in range(len(refs))
    ]


def _outcome(ref: ray.ObjectRef, fetch: bool) -> Outcome:
    """The outcome of a finished call."""
    if not fetch:
        return Outcome(value=ref)
    try:
        return Outcome(value=ray.get(ref))
    except ray.exceptions.RayActorError as err:
        return Outcome(fault=f"died ({first_line(err)})", error=err)
    except ray.exceptions.RayError as err:
        fault = as_fault(getattr(err, "cause", None) or err)
        return Outcome(fault=f"failed ({fault})", error=err, kind=fault.kind) if fault else Outcome(error=err)


def first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0][:200] if lines else type(err).__name__


def split(total: int, parts: int) -> dict[int, tuple[int, int]]:
    """Slot -> [start, end): `total` items cut into `parts` near-equal contiguous shares (empty ones left out)."""
    import torch  # here, not at the top: the storage check's task imports this module and needs no torch

    bounds = torch.linspace(0, total, parts + 1).round().long().tolist()
    return {
        slot: (start, end) for slot, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)) if end > start
    }


class FaultLog:
    """Counts of what a run survived; each fault is printed once, as one line naming the actor and what was done."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()  # the generator pool and the scoring thread both count
        self.seen: set[tuple] = set()
        self.messages: list[str] = []  # printed since `take_messages`

    def clear(self) -> None:
        """Forget every count and failure seen (a new run on the same actors)."""
        with self.lock:
            self.counts.clear()
            self.seen.clear()
            self.messages.clear()

    def again(self, failure: tuple) -> bool:
        """Whether `failure` (what failed, and where) was seen before in this run; remembers it."""
        with self.lock:
            seen = failure in self.seen
            self.seen.add(failure)
            return seen

    def record(self, counter: str, message: str, amount: int = 1) -> None:
        self.count(counter, amount)
        tqdm.write(f"fault: {message}")  # on a line of its own, under the progress bar
        with self.lock:
            self.messages.append(message)

    def take_messages(self) -> list[str]:
        """The faults printed since the last call, for the run's history."""
        with self.lock:
            taken, self.messages = self.messages, []
        return taken

    def count(self, counter: str, amount: int = 1) -> None:
        with self.lock:
            self.counts[counter] += amount

    def metrics(self) -> dict[str, float]:
        return {f"faults/{name}": float(self.counts[name]) for name in COUNTERS}


class ActorPool:
    """The actors of one role in numbered slots. `start_actor(slot)` creates slot's actor (in its placement), and
    an actor is up once its `ready_call` method (by default: its constructor) has returned; `replace(slot, why)`
    kills it and waits, bounded, for a new one; past `max_restarts` the run fails. At the end, `close_call` (if
    any) has each actor end the processes it started before it is killed."""

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
        close_call: str | None = None,
    ) -> None:
        self.role, self.counter, self.start_actor, self.faults = role, counter, start_actor, faults
        self.ready_call, self.close_call = ready_call, close_call
        self.max_restarts, self.start_bound = max_restarts, start_bound
        self.actors = [start_actor(slot) for slot in range(size)]
        self.health = [Health.STARTING] * size
        self.restarts = 0

    def name(self, slot: int) -> str:
        return f"{self.role} {slot}"

    def begin_run(self, faults: FaultLog, max_restarts: int, start_bound: Bound) -> None:
        """A new run's fault log and limits; its restarts counted afresh."""
        self.faults, self.max_restarts, self.start_bound, self.restarts = faults, max_restarts, start_bound, 0

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

    def replace(self, slot: int, why: str, then: str = "", counter: str | None = None) -> None:
        """Kill slot's actor (whatever state it is in) and start a new one in its place; `why` and `then` (what
        the caller does next) go into the printed line, counted in `counter` (by default the role's)."""
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
        message = f"{self.name(slot)} {why}; replaced it in {took:.1f} s{then and '; ' + then}"
        self.faults.record(counter or self.counter, message)

    def join(self, actor: ray.actor.ActorHandle) -> None:
        """Take an actor started elsewhere, and up, into a new last slot."""
        self.actors.append(actor)
        self.health.append(Health.HEALTHY)

    def remove_last(self) -> None:
        """Stop the actor of the last slot and drop the slot."""
        ray.kill(self.actors.pop(), no_restart=True)
        self.health.pop()

    def call(
        self,
        method: str,
        args: dict[int, tuple],
        bound: Bound,
        progressing: bool = False,
        stacks_dir: Path | None = None,
    ) -> dict[int, Outcome]:
        """`method(*args[slot])` on each given slot at once, bounded by `bound` (`progressing`: on the actor's
        progress, `gather_progressing`); the outcome of each (an error of the actor's own code is raised: it is a
        bug, not a fault). The stacks of the actors that gave no answer go into `stacks_dir`, named in their
        outcome's fault."""
        slots = list(args)
        refs = [getattr(self.actors[slot], method).remote(*args[slot]) for slot in slots]
        if progressing:
            outcomes = gather_progressing(refs, [self.actors[slot] for slot in slots], bound)
        else:
            outcomes = gather(refs, bound)
        for outcome in outcomes:
            if outcome.raised:
                raise outcome.error
        hung = [slot for slot, outcome in zip(slots, outcomes, strict=True) if outcome.pending]
        if hung:
            why = outcomes[slots.index(hung[0])].fault
            where = stacks.dump(stacks_dir, f"{self.role} {method} {why}", {self.name(s): self.actors[s] for s in hung})
            outcomes = [replace(o, fault=f"{o.fault}{where}") if o.pending else o for o in outcomes]
        return dict(zip(slots, outcomes, strict=True))

    def call_split(self, method: str, items: list, extra: tuple, bound: Bound, doing: str) -> list:
        """`items` split between the actors, `method(share, *extra)` on each at once, bounded by `bound`, returning
        one answer per item. A share whose actor faults is sent again once to its replacement (`doing` names the
        work in the printed line); an item whose share faulted twice answers None."""
        layout = split(len(items), len(self.actors))
        shards, found = dict(layout), {}
        for attempt in (1, 2):
            args = {slot: (items[start:end], *extra) for slot, (start, end) in shards.items()}
            for slot, outcome in self.call(method, args, bound).items():
                if outcome.fault is None:
                    found[slot] = outcome.value
                else:
                    self.replace(slot, f"{outcome.fault} while {doing}", f"{doing} again" if attempt == 1 else "")
            shards = {slot: span for slot, span in shards.items() if slot not in found}
            if not shards:
                break
        return [answer for slot, (start, end) in layout.items() for answer in found.get(slot, [None] * (end - start))]

    def shutdown(self) -> None:
        """Kill every actor; with a `close_call`, first let them end what they started (waiting at most
        `CLOSE_S`), so that no process of theirs outlives the run (killed, an actor's children end only after it)."""
        if self.close_call is not None:
            closing = [getattr(actor, self.close_call).remote() for actor in self.actors]
            ray.wait(closing, num_returns=len(closing), timeout=CLOSE_S)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
