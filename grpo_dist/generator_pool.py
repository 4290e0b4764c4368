"""The generator pool: the run's vLLM engines, a step's prompts streamed to them one request each, a lost engine
replaced.

`generate` keeps the prompts in a queue and sends the next one to the generator with the fewest requests under way,
up to `requests_per_generator` each (half of an even share: enough for an engine to batch, few enough that a fast
engine takes more of the batch and no engine sets the pace); each finished group goes to `on_group` at once (the
reward pool scores it while the rest generate). A generator that dies or does not finish a request within
`faults.generate_timeout_s` (a deadlocked engine) is killed and a new one started in its placement group; `rejoin`,
given by the cluster, brings the new engine into the weight transport and loads the current weights, and its
prompts are generated again. Sampling is seeded per prompt, so the completions are the same whichever engine draws
them (for the same weights).
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import ray

from grpo_dist.actors.generator import Generator
from grpo_dist.config import Config
from grpo_dist.data import PromptRecord
from grpo_dist.faults import ActorPool, FaultLog, first_line
from grpo_dist.placement import Placement, generator_resources
from grpo_dist.transports import wire_backend
from grpo_dist.types import Completion

POLL_S = 0.05  # how often `while_waiting` runs while requests are under way


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
    """One prompt's group being generated: by which slot's actor (the one it was sent to), since when."""

    slot: int
    prompt_index: int
    started: float
    actor: ray.actor.ActorHandle


def requests_per_generator(prompts: int, generators: int, lone_takes_all: bool = True) -> int:
    """How many requests a generator may have under way: half of an even share of the prompts; all of them when
    there is one generator and `lone_takes_all` (no other to share with, and a second wave would cost a wait)."""
    if generators == 1 and lone_takes_all:
        return max(1, prompts)
    return max(1, math.ceil(prompts / (2 * generators)))


PROBE_TIMEOUT_S = 30.0  # an idle engine answers a probe at once


def _start_failure(started: ray.ObjectRef, bound: float) -> str | None:
    """Why a generator's start call (done, or past `bound`) did not bring it up; None when it did."""
    if not ray.wait([started], timeout=0)[0]:
        return f"did not start within {bound:g} s (faults.start_timeout_s)"
    try:
        ray.get(started)
    except ray.exceptions.RayError as err:
        return f"failed to start: {first_line(err)}"
    return None


class GeneratorPool:
    def __init__(self, cfg: Config, model_path: str, placement: Placement, faults: FaultLog) -> None:
        self.cfg, self.model_path, self.placement, self.faults = cfg, model_path, placement, faults
        self.rejoin: Callable[[], None] = lambda: None  # set by the cluster once the weight transport exists
        self.completions: Counter[int] = Counter()  # per slot, since `step_metrics` last read them
        self.tokens: Counter[int] = Counter()  # generated tokens per slot, likewise
        self.busy_s: Counter[int] = Counter()  # seconds a slot had requests under way, likewise
        self.answered: dict[int, float] = {}  # when each slot last answered a request (monotonic)
        self.joining: list[Joining] = []  # asked for while the run goes, not yet in the pool
        self.pool = ActorPool(
            "generator", "generator_restarts", self._start, cfg.rollout.num_generators, faults,
            cfg.faults.max_generator_restarts, cfg.faults.start_timeout_s, ready_call="start",
        )  # fmt: skip

    def _start(self, slot: int) -> ray.actor.ActorHandle:
        cfg = self.cfg
        return (
            ray.remote(Generator)
            .options(**generator_resources(cfg), scheduling_strategy=self.placement.generator_strategy(slot))
            .remote(self.model_path, cfg.rollout, cfg.run.seed + slot, wire_backend(cfg))
        )

    @property
    def actors(self) -> list[ray.actor.ActorHandle]:
        """The current generator actors (a list the weight transport shares: replacements appear in it)."""
        return self.pool.actors

    def generate(
        self,
        prompts: list[PromptRecord],
        group_size: int,
        greedy: bool = False,
        seeds: list[int] | None = None,
        on_group: Callable[[list[Completion]], None] | None = None,
        while_waiting: Callable[[], None] | None = None,
        more: Callable[[], list[tuple[PromptRecord, int]] | None] | None = None,
    ) -> list[Completion]:
        """All prompts' completions, grouped, in prompt order. `seeds`: one sampling seed per prompt. `on_group`
        gets each prompt's group as soon as it is generated; `while_waiting` runs every `POLL_S` while requests are
        under way. A lost generator's prompts are generated again by its replacement. `more`, asked every `POLL_S`,
        streams further prompts with their seeds (numbered on from the last; `seeds` is then required); once it
        answers None the caller has what it needs: the requests still under way are cancelled and the groups
        generated so far returned. An error (from `more`, `while_waiting` or a generator that cannot be replaced)
        cancels the requests under way too. With one generator every prompt goes at once, except in greedy
        evaluation and with in-flight weight updates (prompts sent after an update are sampled by the new weights
        alone)."""
        prompts, seeds = list(prompts), None if seeds is None else list(seeds)
        queue = deque(range(len(prompts)))
        lone_takes_all = not greedy and self.cfg.sync.mode != "in_flight"
        depth = requests_per_generator(len(prompts), len(self.actors), lone_takes_all)
        running: dict[ray.ObjectRef, Request] = {}
        done: dict[int, list[Completion]] = {}  # prompt index -> its group
        busy_since: dict[int, float] = {}
        try:
            while queue or running or more is not None:
                if more is not None:
                    if (streamed := more()) is None:
                        break
                    queue.extend(range(len(prompts), len(prompts) + len(streamed)))
                    prompts += [prompt for prompt, _ in streamed]
                    seeds += [seed for _, seed in streamed]
                self._send(queue, running, depth, prompts, group_size, greedy, seeds)
                self._wait(running, while_waiting is not None or more is not None)
                lost = self._collect(running, done, greedy, on_group)
                self._account_busy(running, busy_since, greedy)
                if while_waiting is not None:
                    while_waiting()
                if self._replace_lost(lost, queue):
                    self.rejoin()
        finally:
            self._cancel(running, queue)
            self._account_busy(running, busy_since, greedy)
        return [completion for index in sorted(done) for completion in done[index]]

    def _cancel(self, running: dict[ray.ObjectRef, Request], queue: deque) -> None:
        """Drop the queued prompts and cancel the requests under way (each engine aborts its request)."""
        queue.clear()
        for call in running:
            ray.cancel(call)
        running.clear()

    def _send(self, queue, running, depth, prompts, group_size, greedy, seeds) -> None:
        """Hand queued prompts, one request each, to the generators with the fewest under way, up to `depth`."""
        under_way = Counter({slot: 0 for slot in range(len(self.actors))})
        under_way.update(request.slot for request in running.values())
        while queue:
            slot, count = min(under_way.items(), key=lambda item: (item[1], item[0]))
            if count >= depth:
                return
            index = queue.popleft()
            actor = self.actors[slot]
            call = actor.generate.remote(prompts[index].token_ids, group_size, greedy, index, seeds and seeds[index])
            running[call] = Request(slot, index, time.monotonic(), actor)
            under_way[slot] += 1

    def _wait(self, running: dict[ray.ObjectRef, Request], poll: bool) -> None:
        """Until a request finishes, the oldest passes its bound, or (with `poll`) `POLL_S` has gone by."""
        if not running:
            time.sleep(POLL_S)  # only while `more` may stream further prompts
            return
        deadline = min(self._progress(running).values()) + self.cfg.faults.generate_timeout_s
        timeout = max(0.0, deadline - time.monotonic())
        ray.wait(list(running), num_returns=1, timeout=min(timeout, POLL_S) if poll else timeout)

    def _progress(self, running: dict[ray.ObjectRef, Request]) -> dict[int, float]:
        """For each slot with requests under way, since when it has been without progress: its last answer, or
        when its oldest request under way was sent if that is later."""
        progress: dict[int, float] = {}
        for request in running.values():
            progress[request.slot] = min(progress.get(request.slot, request.started), request.started)
        return {slot: max(since, self.answered.get(slot, since)) for slot, since in progress.items()}

    def _collect(self, running, done, greedy, on_group) -> list[tuple[Request, str]]:
        """Take every finished request's group; the requests lost with their generator (dead, or hung: no answer
        for `faults.generate_timeout_s` while it had requests under way), with why."""
        bound = self.cfg.faults.generate_timeout_s
        finished = ray.wait(list(running), num_returns=len(running), timeout=0)[0] if running else []
        lost: list[tuple[Request, str]] = []
        for call in finished:
            request = running.pop(call)
            try:
                done[request.prompt_index] = group = ray.get(call)
            except ray.exceptions.RayActorError as err:
                lost.append((request, f"died ({first_line(err)})"))
                continue
            self.answered[request.slot] = time.monotonic()
            if not greedy:  # training samples, not a held-out evaluation
                self.completions[request.slot] += len(group)
                self.tokens[request.slot] += sum(len(c.token_ids) for c in group)
            if on_group is not None:
                on_group(group)
        now = time.monotonic()
        hung = {slot for slot, since in self._progress(running).items() if now - since > bound}
        for call in [call for call, request in running.items() if request.slot in hung]:
            lost.append((running.pop(call), f"gave no answer within {bound:g} s"))
        return lost

    def _account_busy(self, running, busy_since: dict[int, float], greedy: bool) -> None:
        """Add to each slot's busy time the spans in which it had requests under way."""
        if greedy:
            return
        now, busy = time.monotonic(), {request.slot for request in running.values()}
        for slot in busy - busy_since.keys():
            busy_since[slot] = now
        for slot in set(busy_since) - busy:
            self.busy_s[slot] += now - busy_since.pop(slot)

    def _replace_lost(self, lost: list[tuple[Request, str]], queue: deque) -> bool:
        """Put lost prompts back in the queue and replace their generators, unless one was replaced already (by a
        reconnect after an earlier loss); returns whether any was replaced now."""
        replaced = False
        by_actor: dict[int, list[tuple[Request, str]]] = {}
        for request, why in lost:
            queue.appendleft(request.prompt_index)
            by_actor.setdefault(id(request.actor), []).append((request, why))
        self.faults.count("regenerated", len(lost))
        for requests in by_actor.values():
            request, why = requests[0]
            if self.actors[request.slot] is request.actor:
                self.pool.replace(request.slot, f"{why} while generating {len(requests)} prompts",
                                  "generating them again")  # fmt: skip
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

    def admit(self) -> tuple[list[Joining], list[tuple[Joining, str]]]:
        """Move the joining generators along, without waiting: one that has been placed is started, one that has
        started joins the pool (the caller then connects it to the weight transport), in the order asked for.
        Returns those that joined, and those that could not start, with why (they are given up)."""
        joined, failed = [], []
        while self.joining:
            first = self.joining[0]
            if first.actor is None:
                if not ray.wait([first.placed], timeout=0)[0]:
                    break  # no room yet: on an autoscaling cluster, until a node joins
                first.actor, first.starting = self._start(first.index), time.monotonic()
                first.started = getattr(first.actor, self.pool.ready_call).remote()
            bound = self.cfg.faults.start_timeout_s
            if not ray.wait([first.started], timeout=0)[0] and time.monotonic() - first.starting <= bound:
                break
            self.joining.pop(0)
            if why := _start_failure(first.started, bound):
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
        """`generators/count` and `/joining` (asked for, not yet in the pool), and each generator's completions and
        tokens per second (of the time it had requests under way) since the last call."""
        metrics = {"generators/count": float(len(self.actors)), "generators/joining": float(len(self.joining))}
        for slot in range(len(self.actors)):
            metrics[f"generators/{slot}/completions"] = float(self.completions[slot])
            metrics[f"generators/{slot}/tokens_per_s"] = (
                self.tokens[slot] / self.busy_s[slot] if self.busy_s[slot] else 0.0
            )
        self.completions, self.tokens, self.busy_s = Counter(), Counter(), Counter()
        return metrics

    def replace_unresponsive(self) -> bool:
        """Probe every generator; replace those that are dead or do not answer. Returns whether any was."""
        outcomes = self.pool.call("current_weight_version", {slot: () for slot in range(len(self.actors))},
                                  PROBE_TIMEOUT_S)  # fmt: skip
        lost = {slot: outcome.fault for slot, outcome in outcomes.items() if outcome.fault is not None}
        for slot, fault in lost.items():
            self.pool.replace(slot, fault)
        return bool(lost)

    def shutdown(self) -> None:
        self.pool.shutdown()
        for joining in self.joining:
            if joining.actor is not None:
                ray.kill(joining.actor, no_restart=True)
