"""The reward pool: reward workers scoring a step's completions in parallel, and every reward failure made visible.

A worker that dies (user code calling `os._exit`, a crashing C extension) or scores no completion of its share for
`faults.score_timeout_s` (a call stuck holding the interpreter) is killed and replaced, and its share is scored
again on the new worker up to `faults.rescore_attempts` times; after that those completions are unscored. A worker
reporting half its threads stuck in calls past `reward.timeout_s` is replaced before it runs out of threads.

`RewardFailures` counts each function's failures per step (`reward_failures/<name>`) and their kinds
(`reward_failures/why/<kind>`, `types.FAILURE_KINDS`), and the completions that scored a floor for a call they made
fail (`reward_failures/floored`: timeout, raised, memory, crashed, under `reward.on_failure: floor`); it prints the
first error of each kind with the function's name, says once when a function scores its floor on most completions
of a step (more likely broken than broken by them), and stops a run that is scoring (almost) nothing: only unscored
completions count toward that stop, never floored ones. A completion whose functions all scored but whose weighted
sum is out of range is counted in `reward_failures/weighted_sum`; a trajectory whose environment or agent raised
(`ScoreRequest.failure`) is unscored without a call, the first such failure of the run printed.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import ray
from tqdm import tqdm

from grpo_dist.cluster.actors.reward_worker import RewardWorker
from grpo_dist.cluster.placement import Placement
from grpo_dist.config import Config
from grpo_dist.faults import ActorPool, Bounds, FaultLog, RunFailed, split
from grpo_dist.rewards import counters
from grpo_dist.rewards.registry import WEIGHTED_SUM
from grpo_dist.sandbox import jail
from grpo_dist.types import FAILURE_KINDS, Failure, Score, ScoreRequest

TRAJECTORY = "a trajectory"
"""Where `RewardFailures` keeps the first failed trajectory's reason, beside each reward function's first error."""


class RewardPool:
    def __init__(self, cfg: Config, placement: Placement, faults: FaultLog) -> None:
        self.cfg, self.placement, self.faults = cfg, placement, faults
        self.bounds = Bounds.of(cfg)
        self.names = [spec.name for spec in cfg.reward.functions]
        self.isolation = {"sandbox/namespaces": float(jail.status().namespaces)} if cfg.model_code_runs else {}
        reward = cfg.reward
        self.failures = RewardFailures(
            self.names, reward.max_unscored_fraction, reward.max_unscored_steps, floor=reward.on_failure == "floor"
        )
        self.counts: Counter[str] = Counter()  # what the built-ins counted since the last step (`rewards.counters`)
        named = {*self.names, *cfg.judges}
        self.counted = {key for key in counters.NOTES if key.partition("/")[0] in named}  # logged every step
        self.said: set[str] = set()
        self.pool = ActorPool(
            "reward worker",
            "reward_worker_restarts",
            self._start,
            cfg.reward.num_workers,
            faults,
            cfg.faults.max_reward_worker_restarts,
            self.bounds.start,
            close_call="close",
        )
        self.judge = self.model = None
        if cfg.reward.judge is not None:
            from grpo_dist.cluster.judge_pool import JudgePool

            self.judge = JudgePool(cfg, faults)
        if cfg.reward.model is not None:
            from grpo_dist.cluster.reward_model_pool import RewardModelPool

            self.model = RewardModelPool(cfg, faults)

    def wait_ready(self) -> None:
        """Until every reward worker, judge engine and reward-model actor is up (each start bounded by
        `faults.start_timeout_s`): a model that cannot load fails here, before the first step."""
        self.pool.wait_ready()
        for pool in (self.judge, self.model):
            if pool is not None:
                pool.pool.wait_ready()

    def _start(self, slot: int) -> ray.actor.ActorHandle:
        reward = self.cfg.reward
        return (
            ray.remote(concurrency_groups={"heartbeat": 1})(RewardWorker)  # `progress` answers while it scores
            .options(num_cpus=reward.num_cpus, scheduling_strategy=self.placement.reward_strategy(slot))
            .remote(reward, self.cfg.judges)
        )

    def score(self, requests: list[ScoreRequest], judge: str | None = None) -> list[Score]:
        """Score in parallel across the workers, order kept; lost shares are scored again, then left unscored.
        `judge`: by that eval reward (one of `Config.judges`) alone; its failures are not counted as the training
        rewards' are. With an LLM judge its verdicts are asked first and handed to the reward function `judge`.
        A request whose trajectory failed (`ScoreRequest.failure`) is unscored without calling any function."""
        kept = [request for request in requests if request.failure is None]
        scored = iter(self._score(kept, judge) if kept else [])
        width = 1 if judge is not None else len(self.names)
        scores = [next(scored) if request.failure is None else _unscored(width) for request in requests]
        if judge is None:
            self.failures.observe(scores, [request.failure for request in requests if request.failure is not None])
        return scores

    def _score(self, requests: list[ScoreRequest], judge: str | None) -> list[Score]:
        """`score` of requests that can be scored."""
        if self.judge is not None and (judge or "judge") == "judge":
            requests = [
                replace(request, fields={**request.fields, **_verdict(*found)})
                for request, found in zip(requests, self.judge.score(requests), strict=True)
            ]
        if self.model is not None and (judge or "reward_model") == "reward_model":
            requests = [
                replace(request, fields={**request.fields, **_model_score(*found)})
                for request, found in zip(requests, self.model.score(requests), strict=True)
            ]
        shards = split(len(requests), len(self.pool.actors))
        scored: dict[int, list[Score]] = {}
        attempts = 1 + self.cfg.faults.rescore_attempts
        for attempt in range(1, attempts + 1):
            again = "scoring them again" if attempt < attempts else ""
            args = {slot: (requests[start:end], judge) for slot, (start, end) in shards.items()}
            outcomes = self.pool.call("score", args, self.bounds.score, True, self.bounds.stacks_dir)
            for slot, outcome in outcomes.items():
                if outcome.fault is None:
                    scored[slot], exhausted, counts = outcome.value
                    self.counts.update(counts)
                    if exhausted:
                        self.pool.replace(slot, "has half its threads stuck past reward.timeout_s")
                else:
                    self.pool.replace(slot, f"{outcome.fault} while scoring {_count(shards[slot])} completions", again)
            shards = {slot: span for slot, span in shards.items() if slot not in scored}
            if shards and again:
                self.faults.count("rescored", sum(_count(span) for span in shards.values()))
        for slot, span in shards.items():
            self.faults.record(
                "unscored",
                f"{_count(span)} completions left unscored: their reward worker was lost {attempts} times",
                _count(span),
            )
            scored[slot] = [self._lost() for _ in range(_count(span))]
        return [score for slot in sorted(scored) for score in scored[slot]]

    def _lost(self) -> Score:
        why = Failure(
            "worker_lost", f"the reward worker died or hung while running these functions: {', '.join(self.names)}"
        )
        return Score(math.nan, [math.nan] * len(self.names), dict.fromkeys(self.names, why))

    def step_metrics(self) -> dict[str, float]:
        """This step's `reward_failures/*` (see `RewardFailures.end_step`), the judge's `judge/seconds`, where
        the model's code runs, `sandbox/namespaces` (1: it runs in namespaces of its own; 0: best effort), and what
        the built-ins counted (`code_tests/in_process`), each said once on the console the first time it is not 0."""
        judge = self.judge.step_metrics() if self.judge is not None else {}
        judge |= self.model.step_metrics() if self.model is not None else {}
        counted = {key: float(self.counts[key]) for key in self.counted | set(self.counts)}
        for key in sorted(key for key, value in counted.items() if value and key not in self.said):
            self.said.add(key)
            tqdm.write(f"{key}: {counted[key]:g} this step, {counters.NOTES.get(key, 'counted by a reward')}")
        self.counts.clear()
        return self.failures.end_step() | self.isolation | judge | counted

    def shutdown(self) -> None:
        self.pool.shutdown()
        if self.judge is not None:
            self.judge.shutdown()
        if self.model is not None:
            self.model.shutdown()


def _unscored(width: int) -> Score:
    """The score of a failed trajectory: none, from none of the `width` functions (no function failed)."""
    return Score(math.nan, [math.nan] * width)


def _verdict(score: float, why: str | None) -> dict:
    """The fields that carry a judge's verdict to the reward function `judge`."""
    return {"judge_score": None if why else score, "judge_failure": why}


def _model_score(score: float, why: str | None) -> dict:
    """The fields that carry the reward model's score to the reward function `reward_model`."""
    return {"reward_model_score": None if why else score, "reward_model_failure": why}


class RewardFailures:
    """Per-step failure counts of each reward function, the first error of each kind printed with the function's
    name, and a stop when more than `max_fraction` of the completions are unscored `max_steps` steps in a row.
    `floor`: a call the completion made fail scored its function's floor (`reward.on_failure: floor`)."""

    def __init__(self, names: list[str], max_fraction: float, max_steps: int, floor: bool = True) -> None:
        self.names, self.max_fraction, self.max_steps, self.floor = names, max_fraction, max_steps, floor
        self.counts: Counter[str] = Counter()
        self.floored: Counter[str] = Counter()  # calls that scored their function's floor, by function
        self.why: Counter[str] = Counter()  # failed calls by kind (`types.FAILURE_KINDS`)
        self.first: dict[str, str] = {}  # function -> its first error
        self.printed: set[tuple[str, str]] = set()  # (function, kind of failure and its error's first word)
        self.unscored = self.floored_completions = self.total = 0
        self.bad_steps = 0

    def observe(self, scores: list[Score], failed_trajectories: list[str] = ()) -> None:
        """Count a batch's failures; `failed_trajectories`: why each of its trajectories that failed did (their
        scores are among `scores`, unscored), the first printed once per run (they are counted in `agent/failed`)."""
        for why in failed_trajectories:
            if TRAJECTORY not in self.first:
                tqdm.write(f"a trajectory failed: {why} (it is unscored; later failures are counted in agent/failed)")
            self.first.setdefault(TRAJECTORY, why)
        for score in scores:
            for name, failure in score.failures.items():
                self.counts[name] += 1
                floored_call = self.floor and failure.floored
                self.floored[name] += floored_call
                if name != WEIGHTED_SUM:  # not a call that failed
                    self.why[failure.kind] += 1
                self.first.setdefault(name, failure.reason)
                kind = (name, f"{failure.kind} {failure.reason.split(':')[0].split(' ')[0]}")
                if kind not in self.printed:
                    self.printed.add(kind)
                    scored = "it scored the function's floor" if floored_call else "its completion is unscored"
                    tqdm.write(f"reward {name} failed ({failure.kind}): {failure} ({scored}; later failures are "
                               f"counted in reward_failures/{name})")  # fmt: skip
            floored = self.floor and any(failure.floored for failure in score.failures.values())
            self.floored_completions += floored and math.isfinite(score.total)
        self.unscored += sum(not math.isfinite(score.total) for score in scores)
        self.total += len(scores)

    def end_step(self) -> dict[str, float]:
        """This step's `reward_failures/*` metrics (`reward_failures/weighted_sum`: completions whose functions all
        scored but whose weighted sum is out of range); raises `RunFailed` after too many steps scoring nothing."""
        metrics = {f"reward_failures/{name}": float(self.counts[name]) for name in [*self.names, WEIGHTED_SUM]}
        metrics.update({f"reward_failures/why/{kind}": float(self.why[kind]) for kind in FAILURE_KINDS})
        metrics["reward_failures/floored"] = float(self.floored_completions)
        self._say_mostly_floored()
        fraction = self.unscored / max(1, self.total)
        self.bad_steps = self.bad_steps + 1 if fraction > self.max_fraction else 0
        self.counts, self.floored, self.why = Counter(), Counter(), Counter()
        self.unscored = self.floored_completions = self.total = 0
        if self.bad_steps >= self.max_steps:
            errors = "; ".join(f"{name}: {error}" for name, error in self.first.items()) or "none recorded"
            raise RunFailed(
                f"over {self.max_fraction:.0%} of the completions were unscored for {self.bad_steps} steps in a row "
                f"(reward.max_unscored_fraction / max_unscored_steps): nothing would be learned. "
                f"First error of each reward function (and of a failed trajectory): {errors}"
            )
        return metrics

    def _say_mostly_floored(self) -> None:
        """Say once per function when it scored its floor on more than `max_fraction` of this step's completions: a
        reward failing on nearly every completion is more likely broken than broken by them (its first error)."""
        for name, floored in self.floored.items():
            if floored > self.max_fraction * max(1, self.total) and (name, "mostly floored") not in self.printed:
                self.printed.add((name, "mostly floored"))
                tqdm.write(
                    f"warning: reward {name} failed on {floored} of {self.total} completions this step, each scored "
                    f"its floor (reward.on_failure): check the function; its first error: {self.first.get(name)}"
                )


def _count(span: tuple[int, int]) -> int:
    return span[1] - span[0]
