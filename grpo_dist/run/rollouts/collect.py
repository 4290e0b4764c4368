"""Collecting a step's groups: the generator pool generates them and the reward pool scores each group as soon as it
is generated, while the rest generate (the groups that finished while the reward pool was busy go together), so
`time/reward` is the scoring left when generation ends. With `algorithm.distill` the teacher engines score each
group's tokens on the same thread, after its rewards.

This module drives the generation (`grpo_dist.cluster.generator_pool.Generation`) and decides what each of its events
calls for: a finished group is scored, a replaced generator is brought into the weight transport before it takes
work, and with `sync.mode: in_flight` the generators take the learner's new weights as soon as its training step
ends, while they generate (each pauses with its requests kept, loads them and resumes). With dynamic sampling the
batch grows as `Refill` asks.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from grpo_dist.algo.throughput import StepTimer
from grpo_dist.cluster.cluster import Cluster
from grpo_dist.cluster.generator_pool import Generation
from grpo_dist.cluster.reward_pool import RewardPool
from grpo_dist.cluster.teacher_pool import TeacherPool
from grpo_dist.config import Config
from grpo_dist.data import PromptRecord, PromptSampler
from grpo_dist.run.rollouts.dynamic_sampling import Refill, prompt_seeds
from grpo_dist.run.rollouts.rollout import Rollout
from grpo_dist.run.rollouts.staleness import sync_due
from grpo_dist.types import Completion, Score, ScoreRequest


def collect_rollout(
    cfg: Config, cluster: Cluster, sampler: PromptSampler, timer: StepTimer, step: int, in_flight: bool = False
) -> tuple[Rollout, dict[str, float]]:
    """Generate and score step `step`'s groups (with `in_flight`, syncing the generators mid-batch when the bound
    needs it). With dynamic sampling keep only groups with unequal rewards, streaming more prompts until
    `prompts_per_step` are kept. Sampling is seeded by (run seed, step, prompt), so a resumed run draws the same
    completions. Returns the batch and its sampling metrics (`sync/in_flight`: whether a sync came mid-batch)."""
    key = f"{cfg.run.seed}:{step}"
    if not cfg.algorithm.dynamic_sampling:
        prompts = next(sampler)
        rollout, synced = sample_batch(
            cfg, cluster, prompts, prompt_seeds(key, len(prompts), len(prompts)), timer, in_flight
        )
        return rollout, {"sync/in_flight": float(synced)}
    refill = Refill(cfg, sampler, key)
    prompts, seeds = refill.first()
    rollout, synced = sample_batch(cfg, cluster, prompts, seeds, timer, in_flight, refill)
    return refill.batch(rollout), {**refill.metrics(), "sync/in_flight": float(synced)}


def sample_batch(
    cfg: Config,
    cluster: Cluster,
    prompts: list[PromptRecord],
    seeds: list[int],
    timer: StepTimer,
    in_flight: bool = False,
    refill: Refill | None = None,
) -> tuple[Rollout, bool]:
    """Generate and score a batch; whether the generators took new weights mid-batch. With `refill` the batch grows
    as it asks; the rollout returned then holds every prompt sent, numbered as sent, and the groups generated
    before it had enough (a prompt cancelled then has none: `Refill.batch` keeps only prompts it used). A failure
    (a generator that cannot be replaced, a group that cannot be scored) cancels the requests under way."""
    generation = cluster.generators.start(prompts, cfg.rollout.group_size, seeds=seeds)
    scoring = Scoring(cluster.rewards, generation.prompts, refill, cluster.teacher)
    synced = False
    try:
        with timer("generate"):
            try:
                while refill is not None or not generation.finished:
                    if refill is not None:
                        scoring.raise_failure()  # a group that cannot be scored would be waited for forever
                        if (streamed := refill.more()) is None:
                            break  # the step has its groups: the requests still under way are cancelled
                        generation.add([prompt for prompt, _ in streamed], [seed for _, seed in streamed])
                    advanced = generation.advance(poll=in_flight or refill is not None)
                    for group in advanced.groups:
                        scoring.submit(group)
                    if advanced.replaced:
                        cluster.reconnect()
                    if in_flight:
                        synced = update_in_flight(cfg, cluster, timer) or synced
            finally:
                generation.cancel()
        with timer("reward"):
            scores = scoring.scores()
    except BaseException:
        scoring.close(abandon=True)  # a stop or a failure waits for one batch, not all
        raise
    scoring.close()
    return Rollout(generation.prompts, generation.completions(), scores), synced


def update_in_flight(cfg: Config, cluster: Cluster, timer: StepTimer) -> bool:
    """Once the training step under way has ended, sync the generators now if the bound needs it, while they
    generate (`sync.mode: in_flight`). Returns whether it synced."""
    learner, generators = cluster.learner, cluster.generators
    if not (learner.poll() and sync_due(cfg.rollout.max_staleness, generators.weight_version, learner.version)):
        return False
    with timer("sync"):
        cluster.sync_weights()
    return True


def advancing(cluster: Cluster, generation: Generation) -> Iterator[int]:
    """Drive a started generation to its end, a lost generator replaced and brought into the weight transport;
    yields how many groups each wait finished (for a progress bar). Cancelled if left unfinished."""
    try:
        while not generation.finished:
            advanced = generation.advance()
            if advanced.replaced:
                cluster.reconnect()
            yield len(advanced.groups)
    finally:
        generation.cancel()


class Scoring:
    """Groups scored on a thread of their own as they are generated: each `submit` hands the reward pool (and with
    `teacher`, the teacher engines, which set each completion's `teacher_logprobs`) every group generated since its
    last call. With `refill`, each scored group is reported to it."""

    def __init__(
        self,
        rewards: RewardPool,
        prompts: list[PromptRecord],
        refill: Refill | None,
        teacher: TeacherPool | None = None,
    ) -> None:
        self.rewards, self.prompts, self.refill = rewards, prompts, refill  # `prompts` grows as more are sent
        self.teacher = teacher
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scoring")
        self.waiting: list[Completion] = []  # generated, not yet handed to the reward pool
        self.lock = threading.Lock()
        self.batches: list[Future] = []  # each: (completions, their scores)

    def submit(self, group: list[Completion]) -> None:
        with self.lock:
            self.waiting.extend(group)
        self.batches.append(self.thread.submit(self._score_waiting))

    def _score_waiting(self) -> tuple[list[Completion], list[Score]]:
        with self.lock:
            batch = self.waiting.copy()
            self.waiting.clear()
        scores = self.rewards.score(score_requests(self.prompts, batch)) if batch else []
        if self.teacher is not None:
            self.teacher.annotate(batch)
        if self.refill is not None and batch:
            self.refill.scored(self.prompts[:], batch, scores)  # a copy: more prompts may be sent meanwhile
        return batch, scores

    def raise_failure(self) -> None:
        """Raise the error of a batch that failed to score (a reward pool past its restarts)."""
        for batch in self.batches:
            if batch.done() and batch.exception() is not None:
                raise batch.exception()

    def scores(self) -> list[Score]:
        """Every completion's score once all are scored, in prompt order (a group's in its completions' order)."""
        by_prompt: dict[int, list[Score]] = {}
        for batch in self.batches:
            for completion, score in zip(*batch.result(), strict=True):
                by_prompt.setdefault(completion.prompt_index, []).append(score)
        return [score for index in sorted(by_prompt) for score in by_prompt[index]]

    def close(self, abandon: bool = False) -> None:
        """Stop the scoring thread; `abandon`: after the batch it is scoring, drop the rest."""
        self.thread.shutdown(wait=True, cancel_futures=abandon)


def score_requests(prompts: list[PromptRecord], completions: list[Completion]) -> list[ScoreRequest]:
    """What the reward functions judge: the prompt, the completion (a trajectory's last turn) and the row's fields;
    of a trajectory also its conversation (`messages`) and the environment's reward (`environment_reward`), or why
    it failed (then it is not scored)."""
    return [
        ScoreRequest(
            prompts[c.prompt_index].text,
            c.text,
            {**prompts[c.prompt_index].fields, **_episode(c)},
            c.episode.failure if c.episode is not None else None,
            prompts[c.prompt_index].messages,
        )
        for c in completions
    ]


def _episode(completion: Completion) -> dict:
    if completion.episode is None:
        return {}
    return {"messages": completion.episode.messages, "environment_reward": sum(completion.episode.rewards.values())}
