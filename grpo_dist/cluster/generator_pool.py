"""The generator pool: the run's vLLM engines, a batch's prompts streamed to them a few calls each, a lost engine
replaced.

`start(prompts, ...)` begins a `Generation`: its prompts wait in a queue and go to the generator with the fewest
under way, up to `requests_per_generator` each (half of an even share: enough for an engine to batch, few enough
that a fast engine takes more of the batch and no engine sets the pace). A call carries up to a quarter of that
share (`prompts_per_call`): a Ray call per prompt costs the driver and the generator more than the engine's own
work on a small model, while a share sent in a few calls still comes back in parts, each scored while the rest
generate. Each prompt is one engine request (its group). The caller
drives it: each `advance` sends what it can, waits (bounded), and returns the groups finished since the last call
and whether a generator was replaced, for the caller to act on (score them at once; bring a new engine into the
weight transport before it takes work). A generator that dies, whose engine dies or whose device fails (an
`ActorFault`, counted as an engine restart), or that gives no answer within `faults.generate_timeout_s` while it has
requests under way (a deadlocked engine) is killed and a new one started in its placement group, and its prompts are
generated again. Sampling is seeded per prompt, so the completions are the same whichever engine
draws them (for the same weights). The pool owns its members and the weight version they hold.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace

import ray

from grpo_dist.cluster.actors.generator import Generator
from grpo_dist.cluster.placement import Placement, generator_resources
from grpo_dist.config import Config
from grpo_dist.data import PromptRecord
from grpo_dist.faults import POLL, ActorPool, Bound, Bounds, FaultLog, first_line, gather, stacks
from grpo_dist.transports import adapter_slots, wire_backend
from grpo_dist.types import Completion, Sampling

POLL_S = 0.05  # the longest `advance` waits when the caller polls


@dataclass
class Joining:
    """A generator asked for while the run goes: waiting for room (`placed` not ready), then starting."""

    index: int  # its slot once it joins
    placed: ray.ObjectRef  # ready once its placement group is
    asked: float  # when it was asked for
    actor: ray.actor.ActorHandle | None = None
    started: ray.ObjectRef | None = None  # its `start` call
    starting: float = 0.0  # when it was created


@dataclass
class Request:
    """One call under way: the groups of `prompts` (their indices, in order), by which slot's actor (the one it was
    sent to), since when."""

    slot: int
    prompts: tuple[int, ...]
    started: float
    actor: ray.actor.ActorHandle


@dataclass
class Lost:
    """A request lost with its generator, and why: the actor died or hung, or its engine or device failed."""

    request: Request
    why: str
    kind: str | None = None  # an `ActorFault`'s kind: its process lives, its engine or device failed


def restart_counter(kind: str | None) -> str:
    """The `faults/*` counter of a generator replaced after a fault of `kind`."""
    return "engine_restarts" if kind else "generator_restarts"


@dataclass
class Advanced:
    """What one `Generation.advance` brought."""

    groups: list[list[Completion]] = field(default_factory=list)  # each finished prompt's group, as it came
    replaced: bool = False  # a generator was replaced: bring it into the weight transport before the next call


def requests_per_generator(prompts: int, generators: int, lone_takes_all: bool = True) -> int:
    """How many prompts a generator may have under way: half of an even share of them; all of them when there is
    one generator and `lone_takes_all` (no other to share with, and a second wave would cost a wait)."""
    if generators == 1 and lone_takes_all:
        return max(1, prompts)
    return max(1, math.ceil(prompts / (2 * generators)))


CALLS_PER_SHARE = 4  # a generator's share of the prompts comes back in about this many parts


def prompts_per_call(depth: int) -> int:
    """How many prompts one call to a generator carries when it may have `depth` under way: a quarter of them (one
    while `depth` is 4 or less, so that a small share still spreads over the generators a prompt at a time)."""
    return max(1, math.ceil(depth / CALLS_PER_SHARE))


def _start_failure(outcome, bound: Bound) -> str | None:
    """Why a generator's start call (done, or past `bound`) did not bring it up; None when it did."""
    if outcome.pending:
        return f"did not start within {bound}"
    if not outcome.ok:
        return f"failed to start: {first_line(outcome.error)}"
    return None


class GeneratorPool:
    def __init__(self, cfg: Config, model_path: str, placement: Placement, faults: FaultLog) -> None:
        self.cfg, self.model_path, self.placement, self.faults = cfg, model_path, placement, faults
        self.bounds = Bounds.of(cfg)
        self.weight_version = 0  # the weights every generator holds (0: the initial model)
        self.completions: Counter[int] = Counter()  # per slot, since `step_metrics` last read them
        self.tokens: Counter[int] = Counter()  # generated tokens per slot, likewise
        self.busy_s: Counter[int] = Counter()  # seconds a slot had requests under way, likewise
        self.answered: dict[int, float] = {}  # when each slot last answered a request (monotonic)
        self.joining: list[Joining] = []  # asked for while the run goes, not yet in the pool
        self.pool = ActorPool(
            "generator",
            "generator_restarts",
            self._start,
            cfg.rollout.num_generators,
            faults,
            cfg.faults.max_generator_restarts,
            self.bounds.start,
            ready_call="start",
            close_call="close",
        )

    def _start(self, slot: int) -> ray.actor.ActorHandle:
        cfg = self.cfg
        return (
            ray.remote(Generator)
            .options(**generator_resources(cfg), scheduling_strategy=self.placement.generator_strategy(slot))
            .remote(
                self.model_path,
                cfg.rollout,
                cfg.run.seed + slot,
                wire_backend(cfg),
                cfg.environment,
                (cfg.reward.isolation, cfg.reward.sandbox_env),
                adapter_slots(cfg),
                cfg.faults.inject,
            )
        )

    @property
    def actors(self) -> list[ray.actor.ActorHandle]:
        """The current generator actors (a list the weight transport shares: replacements appear in it)."""
        return self.pool.actors

    def begin_run(self, cfg: Config, faults: FaultLog) -> None:
        """A new run on these generators (their engines started as `cfg` would start them): its rollout settings in
        each, its fault log and bounds, the counts since the last run's step read and dropped."""
        self.cfg, self.faults, self.bounds = cfg, faults, Bounds.of(cfg)
        for joining in self.joining:  # asked for by an earlier run
            self._drop(joining)
        self.joining = []
        self.pool.begin_run(faults, cfg.faults.max_generator_restarts, self.bounds.start)
        slots = range(len(self.actors))
        outcomes = self.pool.call(
            "configure", {slot: (cfg.rollout, cfg.faults.inject) for slot in slots}, self.bounds.probe
        )
        for slot, outcome in outcomes.items():
            if outcome.fault is not None:  # a new one starts with `cfg`'s settings
                self.pool.replace(slot, outcome.fault, counter=restart_counter(outcome.kind))
        self.answered = {}
        self.step_metrics()

    def loaded(self, weight_version: int) -> None:
        """Record that every generator now holds the weights of `weight_version` (after a weight sync)."""
        self.weight_version = weight_version

    def start(
        self,
        prompts: list[PromptRecord],
        group_size: int,
        evaluation: Sampling | None = None,
        seeds: list[int] | None = None,
    ) -> Generation:
        """Begin generating `group_size` completions of each prompt (`seeds`: one sampling seed per prompt), sampled
        as `rollout` says or, for an evaluation, as `evaluation` says; the caller drives it with
        `Generation.advance`. With one generator every prompt goes at once, except in an evaluation and with
        in-flight weight updates (prompts sent after an update are sampled by the new weights alone)."""
        lone_takes_all = evaluation is None and self.cfg.sync.mode != "in_flight"
        depth = requests_per_generator(len(prompts), len(self.actors), lone_takes_all)
        seeds = None if seeds is None else list(seeds)
        return Generation(self, list(prompts), group_size, evaluation, seeds, depth)

    def _progress(self, running: dict[ray.ObjectRef, Request]) -> dict[int, float]:
        """For each slot with requests under way, since when it has been without progress: its last answer, or
        when its oldest request under way was sent if that is later."""
        progress: dict[int, float] = {}
        for request in running.values():
            progress[request.slot] = min(progress.get(request.slot, request.started), request.started)
        return {slot: max(since, self.answered.get(slot, since)) for slot, since in progress.items()}

    def _answered(self, request: Request, group: list[Completion], evaluation: bool) -> None:
        self.answered[request.slot] = time.monotonic()
        for completion in group:
            completion.generator = request.slot
        if not evaluation:  # training samples
            self.completions[request.slot] += len(group)
            self.tokens[request.slot] += sum(len(c.token_ids) for c in group)

    def _busy(self, slot: int, seconds: float) -> None:
        self.busy_s[slot] += seconds

    def _replace_lost(self, lost: list[Lost]) -> bool:
        """Replace the generators of lost requests, unless one was replaced already (after an earlier loss);
        returns whether any was replaced now."""
        replaced = False
        by_actor: dict[int, list[Lost]] = {}
        for each in lost:
            by_actor.setdefault(id(each.request.actor), []).append(each)
        self.faults.count("regenerated", sum(len(each.request.prompts) for each in lost))
        for requests in by_actor.values():
            first = requests[0]
            if self.actors[first.request.slot] is first.request.actor:
                self.pool.replace(
                    first.request.slot,
                    f"{first.why} while generating {sum(len(each.request.prompts) for each in requests)} prompts",
                    "generating them again",
                    restart_counter(first.kind),
                )
                replaced = True
        return replaced

    @property
    def wanted(self) -> int:
        """The generators asked for: those running and those still joining."""
        return len(self.actors) + len(self.joining)

    def request(self, count: int) -> None:
        """Ask for `count` generators. New ones join later (`admit`), the run going on meanwhile; the last ones
        (those still joining first) are stopped now: between steps, when no generator holds work."""
        while self.wanted < count:
            index = self.wanted
            self.joining.append(Joining(index, self.placement.request_generator(self.cfg, index), time.monotonic()))
        while self.wanted > count:
            if self.joining:
                self._drop(self.joining.pop())
            else:
                self.pool.remove_last()
                self.placement.remove_generator(len(self.actors))
        try:
            self.placement.ask_autoscaler()
        except Exception as err:  # a hint to the cluster: the run goes on without it
            print(f"warning: could not ask Ray's autoscaler for the generators' room ({type(err).__name__}: {err})")

    def admit(self) -> tuple[list[Joining], list[tuple[Joining, str]]]:
        """Move the joining generators along, without waiting: one that has been placed is started, one that has
        started joins the pool (the caller then connects it to the weight transport), in the order asked for.
        Returns those that joined, and those that could not start, with why (they are given up)."""
        joined, failed = [], []
        while self.joining:
            first = self.joining[0]
            if first.actor is None:
                if gather([first.placed], POLL)[0].pending:
                    break  # no room yet: on an autoscaling cluster, until a node joins
                first.actor, first.starting = self._start(first.index), time.monotonic()
                first.started = getattr(first.actor, self.pool.ready_call).remote()
            bound, (started,) = self.bounds.start, gather([first.started], POLL)
            if started.pending and time.monotonic() - first.starting <= bound.seconds:
                break
            self.joining.pop(0)
            if why := _start_failure(started, bound):
                failed.append((first, why))
                self._drop(first)
            else:
                self.pool.join(first.actor)
                joined.append(first)
        return joined, failed

    def _drop(self, joining: Joining) -> None:
        """Give up a joining generator: its actor (if started) and its placement group."""
        if joining.actor is not None:
            ray.kill(joining.actor, no_restart=True)
        self.placement.remove_generator(joining.index)

    def step_metrics(self) -> dict[str, float]:
        """`generators/count` and `/joining` (asked for, not yet in the pool), `generators/tokens` (the completion
        tokens the pool generated since the last call), each generator's completions and tokens per second (of the
        time it had requests under way) since the last call; the engines' own statistics (`engine/*`: the highest
        KV-cache use, running and waiting requests of any engine, preemptions of all, an evaluation's requests
        included) and the most memory an engine holds (`memory/engine_gb`)."""
        metrics = {"generators/count": float(len(self.actors)), "generators/joining": float(len(self.joining))}
        metrics["generators/tokens"] = float(sum(self.tokens.values()))  # all the pool generated since the last call
        for slot in range(len(self.actors)):
            metrics[f"generators/{slot}/completions"] = float(self.completions[slot])
            metrics[f"generators/{slot}/tokens_per_s"] = (
                self.tokens[slot] / self.busy_s[slot] if self.busy_s[slot] else 0.0
            )
        self.completions, self.tokens, self.busy_s = Counter(), Counter(), Counter()
        outcomes = self.pool.call("engine_stats", {slot: () for slot in range(len(self.actors))}, self.bounds.probe)
        found = [outcome.value for outcome in outcomes.values() if outcome.fault is None]  # a lost one: next step's
        if found:
            for key in ("kv_cache_usage_max", "running_max", "waiting_max"):
                metrics[f"engine/{key}"] = max(each[key] for each in found)
            metrics["engine/preemptions"] = sum(each["preemptions"] for each in found)
            if held := [each["memory_gb"] for each in found if "memory_gb" in each]:
                metrics["memory/engine_gb"] = max(held)
        return metrics

    def replace_unresponsive(self) -> bool:
        """Probe every generator; replace those that are dead or do not answer. Returns whether any was."""
        outcomes = self.pool.call(
            "current_weight_version", {slot: () for slot in range(len(self.actors))}, self.bounds.probe
        )
        lost = {slot: outcome for slot, outcome in outcomes.items() if outcome.fault is not None}
        for slot, outcome in lost.items():
            self.pool.replace(slot, outcome.fault, counter=restart_counter(outcome.kind))
        return bool(lost)

    def shutdown(self) -> None:
        self.pool.shutdown()
        for joining in self.joining:
            if joining.actor is not None:
                ray.kill(joining.actor, no_restart=True)


class Generation:
    """One batch of prompts being generated by the pool, driven by its caller (`advance`), which may stream more
    prompts in (`add`) and stop it early (`cancel`: the engines abort the requests under way)."""

    def __init__(self, pool: GeneratorPool, prompts, group_size: int, evaluation: Sampling | None, seeds, depth: int):
        self.pool, self.prompts, self.group_size, self.seeds = pool, prompts, group_size, seeds
        self.evaluation = evaluation
        self.depth = depth
        self.queue = deque(range(len(prompts)))
        self.per_call = prompts_per_call(depth)
        self.running: dict[ray.ObjectRef, Request] = {}
        self.done: dict[int, list[Completion]] = {}  # prompt index -> its group
        self.busy_since: dict[int, float] = {}

    @property
    def finished(self) -> bool:
        """Whether every prompt sent so far has its group."""
        return not self.queue and not self.running

    def add(self, prompts: list[PromptRecord], seeds: list[int]) -> None:
        """Stream more prompts in, numbered on from the last (the generation must have been started with seeds)."""
        self.queue.extend(range(len(self.prompts), len(self.prompts) + len(prompts)))
        self.prompts += prompts
        self.seeds += seeds

    def advance(self, poll: bool = False) -> Advanced:
        """Send what the generators have room for, wait until a group finishes, a generator passes its bound or
        (with `poll`) `POLL_S` has gone by; the groups finished by then, and whether a lost generator was replaced
        (its prompts are queued again)."""
        self._send()
        outcomes = self._wait(poll)
        groups, lost = self._collect(outcomes)
        self._account_busy()
        for each in reversed(lost):  # the lost prompts first, in their order
            self.queue.extendleft(reversed(each.request.prompts))
        return Advanced(groups, bool(lost) and self.pool._replace_lost(lost))

    def completions(self) -> list[Completion]:
        """Every group finished so far, in prompt order."""
        return [completion for index in sorted(self.done) for completion in self.done[index]]

    def cancel(self) -> None:
        """Drop the queued prompts and cancel the requests under way (each engine aborts its request)."""
        self.queue.clear()
        for call in self.running:
            ray.cancel(call)
        self.running.clear()
        self._account_busy()

    def _send(self) -> None:
        """Hand queued prompts to the generators with the fewest prompts under way, up to `depth` each, in calls of
        up to `per_call` prompts."""
        actors = self.pool.actors
        under_way = Counter({slot: 0 for slot in range(len(actors))})
        for request in self.running.values():
            under_way[request.slot] += len(request.prompts)
        while self.queue:
            slot, count = min(under_way.items(), key=lambda item: (item[1], item[0]))
            if count >= self.depth:
                return
            taken = min(self.per_call, self.depth - count, len(self.queue))
            indices = tuple(self.queue.popleft() for _ in range(taken))
            call = actors[slot].generate_each.remote(
                [self._prompt(index) for index in indices], self.group_size, self.evaluation
            )
            self.running[call] = Request(slot, indices, time.monotonic(), actors[slot])
            under_way[slot] += taken

    def _prompt(self, index: int) -> tuple:
        """What a generator samples prompt `index` from: its token ids, index, seed, (with an environment, where
        a trajectory starts from it) its row, and its images (None without)."""
        record = self.prompts[index]
        seed = self.seeds[index] if self.seeds else None
        row = record.row if self.pool.cfg.environment is not None else None
        return record.token_ids, index, seed, row, list(record.images) or None

    def _wait(self, poll: bool) -> list:
        """Until a request finishes, the slot longest without progress passes the generate bound, or (with
        `poll`) `POLL_S` has gone by; the outcome of every request under way."""
        if not self.running:
            time.sleep(POLL_S)  # only while the caller may stream further prompts
            return []
        bound = self.pool.bounds.generate
        deadline = min(self.pool._progress(self.running).values()) + bound.seconds
        timeout = max(0.0, deadline - time.monotonic())
        wait = replace(bound, seconds=min(timeout, POLL_S) if poll else timeout)
        return gather(list(self.running), wait, count=1)

    def _collect(self, outcomes: list) -> tuple[list[list[Completion]], list[Lost]]:
        """Take every finished request's group; the requests lost with their generator (dead, its engine or device
        failed, or hung: no answer within the generate bound while it had requests under way), with why."""
        groups: list[list[Completion]] = []
        lost: list[Lost] = []
        for call, outcome in zip(list(self.running), outcomes, strict=True):
            if outcome.pending:
                continue
            request = self.running.pop(call)
            if outcome.raised:
                raise outcome.error
            if outcome.fault:
                lost.append(Lost(request, outcome.fault, outcome.kind))
                continue
            for index, group in zip(request.prompts, outcome.value, strict=True):
                self.done[index] = group
                self.pool._answered(request, group, self.evaluation is not None)
                groups.append(group)
        bound, now = self.pool.bounds.generate, time.monotonic()
        hung = {slot for slot, since in self.pool._progress(self.running).items() if now - since > bound.seconds}
        where = ""
        if hung:
            named = {f"generator {r.slot}": r.actor for r in self.running.values() if r.slot in hung}
            where = stacks.dump(self.pool.bounds.stacks_dir, f"generate: no answer within {bound}", named)
        for call in [call for call, request in self.running.items() if request.slot in hung]:
            lost.append(Lost(self.running.pop(call), f"gave no answer within {bound}{where}"))
        return groups, lost

    def _account_busy(self) -> None:
        """Add to each slot's busy time the spans in which it had requests under way."""
        if self.evaluation is not None:
            return
        now, busy = time.monotonic(), {request.slot for request in self.running.values()}
        for slot in busy - self.busy_since.keys():
            self.busy_since[slot] = now
        for slot in set(self.busy_since) - busy:
            self.pool._busy(slot, now - self.busy_since.pop(slot))
