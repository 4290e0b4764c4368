"""Rollout batches for the learner: drawn on time (on-policy) or one step ahead, with every sample's staleness bounded.

With `rollout.max_staleness` k = 0 a step's batch is generated and scored when the step begins, by the weights the
learner has: on-policy. With k >= 1 the next step's batch is generated and scored while the learner trains
(`RolloutQueue.draw_ahead`), by weights up to k updates older than the learner's when it trains on them
(`sync_due` says when the generators must get new weights for that to hold). `bound_staleness` enforces the bound
per sample (groups holding an older completion are dropped and counted) and reports it; the learner corrects for
the older sampling policy (`algorithm.old_logprobs`, `algorithm.is_cap`). With `sync.mode: in_flight` the generators
take new weights mid-batch (`update_in_flight`); a completion whose tokens span versions counts as old as its
oldest token. With dynamic sampling the batch is refilled from the stream (`Refill`): each group that teaches
nothing calls for another prompt as soon as it is scored.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from grpo_dist.algo import informative_groups, multi_reward_advantages, overlong_penalty
from grpo_dist.cluster import Cluster
from grpo_dist.config import Config
from grpo_dist.data import PromptRecord, PromptSampler
from grpo_dist.metrics import StepTimer
from grpo_dist.rollout import Rollout
from grpo_dist.types import Completion, Score, ScoreRequest


class RolloutQueue:
    """The batch drawn ahead for the next step (k >= 1), and the run's state from before it was drawn: a
    checkpoint taken now must not skip its prompts (a resumed run draws them again)."""

    def __init__(self, cfg: Config, cluster: Cluster, sampler: PromptSampler) -> None:
        self.cfg, self.cluster, self.sampler = cfg, cluster, sampler
        self.ahead: tuple[int, Rollout, dict[str, float]] | None = None  # (step, batch, its sampling metrics)
        self.sampler_before_ahead: dict | None = None

    def take(self, step: int, timer: StepTimer) -> tuple[Rollout, dict[str, float]]:
        """Step `step`'s batch: the one drawn ahead for it, or one generated and scored now."""
        if self.ahead is not None and self.ahead[0] == step:
            _, rollout, metrics = self.ahead
            self.reset()
            return rollout, metrics
        self.reset()
        rollout, metrics = collect_rollout(self.cfg, self.cluster, self.sampler, timer, step)
        return rollout, {**metrics, "sync/in_flight": 0.0}

    def draw_ahead(self, step: int, timer: StepTimer) -> None:
        """With k >= 1, generate and score step `step`'s batch now (while the learner trains on the current one);
        with `sync.mode: in_flight` the generators get the new weights as soon as that training step ends."""
        cfg = self.cfg
        if cfg.rollout.max_staleness == 0 or step > cfg.run.steps:
            return
        before = self.sampler.state_dict()
        synced = False

        def in_flight() -> None:
            nonlocal synced
            synced = update_in_flight(cfg, self.cluster, timer) or synced

        hook = in_flight if cfg.sync.mode == "in_flight" else None
        rollout, metrics = collect_rollout(cfg, self.cluster, self.sampler, timer, step, hook)
        metrics["sync/in_flight"] = float(synced)
        self.ahead, self.sampler_before_ahead = (step, rollout, metrics), before

    def state_dict(self) -> dict:
        """For a checkpoint: the sampler from before the batch drawn ahead, and that batch with the sampler after it.
        A run resumed with k >= 1 trains on the batch as the uninterrupted run would; one resumed with k = 0 draws
        its prompts again."""
        if self.ahead is None:
            return {"sampler": self.sampler.state_dict(), "ahead": None}
        return {
            "sampler": self.sampler_before_ahead,
            "ahead": {"batch": self.ahead, "sampler": self.sampler.state_dict(), "settings": batch_settings(self.cfg)},
        }

    def load_state_dict(self, state: dict, step: int) -> None:
        """Back to a checkpoint of step `step` (`state_dict`); a checkpoint from before batches drawn ahead were
        kept holds the sampler only."""
        self.reset()
        ahead = state.get("ahead")
        if ahead and ahead["settings"] != batch_settings(self.cfg):
            print("the checkpoint's batch drawn ahead was sampled or scored under other settings (rewards, batch "
                  "size, sampling): its prompts are drawn again")  # fmt: skip
        elif ahead and self.cfg.rollout.max_staleness >= 1 and ahead["batch"][0] == step + 1:
            self.sampler.load_state_dict(ahead["sampler"])
            self.ahead, self.sampler_before_ahead = ahead["batch"], state["sampler"]
            return
        self.sampler.load_state_dict(state["sampler"])

    def queued_prompts(self) -> int:
        return len(self.ahead[1].prompts) if self.ahead is not None else 0

    def reset(self) -> None:
        """Forget the batch drawn ahead (taken, or stale after the learner group restarted from a checkpoint)."""
        self.ahead = self.sampler_before_ahead = None


def batch_settings(cfg: Config) -> dict:
    """The settings a batch drawn ahead was generated and scored under: a run resumed with others draws it again."""
    rollout, algo = cfg.rollout, cfg.algorithm
    return {
        "reward.functions": [spec.model_dump(mode="json") for spec in cfg.reward.functions],
        "data.prompts_per_step": cfg.data.prompts_per_step,
        "algorithm.dynamic_sampling": [algo.dynamic_sampling, algo.max_sampling_rounds],
        "rollout.sampling": [rollout.temperature, rollout.top_p],
    }


def sync_due(cfg: Config, cluster: Cluster) -> bool:
    """Whether the generators need the learner's weights now, so that the next batch they generate is at most k
    updates older than the learner when it trains on it (one update later when it is drawn ahead)."""
    k = cfg.rollout.max_staleness
    lead = 1 if k >= 1 else 0
    return cluster.weight_version < cluster.learner_version + lead - k


def update_in_flight(cfg: Config, cluster: Cluster, timer: StepTimer) -> bool:
    """Once the training step under way has ended, sync the generators now if the bound needs it, while they
    generate: each pauses with its requests kept, loads the weights and resumes (`sync.mode: in_flight`). Returns
    whether it synced."""
    if not (cluster.poll_training() and sync_due(cfg, cluster)):
        return False
    with timer("sync"):
        cluster.sync_weights()
    return True


def bound_staleness(rollout: Rollout, learner_version: int, k: int) -> tuple[Rollout, dict[str, float]]:
    """Drop every group holding a completion sampled more than k versions before `learner_version`; the kept
    completions' staleness (mean, max) and how many were dropped."""
    too_old = {c.prompt_index for c in rollout.completions if learner_version - c.weight_version > k}
    kept = rollout.select_groups([index not in too_old for index in range(len(rollout.prompts))])
    kept_staleness = torch.tensor([learner_version - c.weight_version for c in kept.completions], dtype=torch.float)
    metrics = {
        "staleness/dropped": float(len(rollout.completions) - len(kept.completions)),
        "staleness/spanning": float(sum(c.newest_weight_version is not None for c in kept.completions)),
    }
    if kept.completions:
        metrics.update({"staleness/mean": kept_staleness.mean().item(), "staleness/max": kept_staleness.max().item()})
    return kept, metrics


def collect_rollout(
    cfg: Config,
    cluster: Cluster,
    sampler: PromptSampler,
    timer: StepTimer,
    step: int,
    while_generating: Callable[[], None] | None = None,
) -> tuple[Rollout, dict[str, float]]:
    """Generate and score a step's groups. With dynamic sampling (DAPO) keep only groups with unequal rewards,
    streaming more prompts until `prompts_per_step` are kept (`Refill`). Sampling is seeded by (run seed, step,
    prompt), so a resumed run draws the same completions."""
    group_size, key = cfg.rollout.group_size, f"{cfg.run.seed}:{step}"
    if not cfg.algorithm.dynamic_sampling:
        prompts = next(sampler)
        return sample_batch(cluster, prompts, prompt_seeds(key, len(prompts), len(prompts)), group_size, timer,
                            while_generating), {}  # fmt: skip
    refill = Refill(cfg, sampler, key)
    prompts, seeds = refill.first()
    rollout = sample_batch(cluster, prompts, seeds, group_size, timer, while_generating, refill)
    return refill.batch(rollout), refill.metrics()


def prompt_seeds(key: str, batch: int, count: int) -> list[int]:
    """The sampling seeds of a step's first `count` prompts: batch after batch of `batch`, each batch's drawn from
    its own stream (a step's first batch is seeded alike with and without dynamic sampling)."""
    seeds: list[int] = []
    for round_ in range(1, math.ceil(count / batch) + 1):
        stream = random.Random(f"{key}:{round_}")
        seeds += [stream.getrandbits(31) for _ in range(batch)]
    return seeds[:count]


class Refill:
    """Dynamic sampling's prompts for one step, streamed as scored groups show how many more are needed.

    A group whose rewards are all equal teaches nothing (DAPO, arXiv 2503.14476) and is dropped. The step trains on
    the informative groups of the shortest run of prompts, in the order drawn, that holds `prompts_per_step` of them
    (or of all `max_sampling_rounds` x `prompts_per_step` prompts, the cap): the same groups whatever order the
    engines finish them in, so a resumed run trains on the same batch. To keep the engines busy it sends ahead as
    many prompts as the informative fraction seen so far says are needed; prompts past that run are cancelled or
    their groups dropped, and the sampler is wound back to just after it (the next step draws them again).
    """

    def __init__(self, cfg: Config, sampler: PromptSampler, key: str) -> None:
        self.wanted, self.group_size = cfg.data.prompts_per_step, cfg.rollout.group_size
        self.cap = cfg.algorithm.max_sampling_rounds * self.wanted
        self.cfg, self.sampler, self.start = cfg, sampler, sampler.state_dict()
        self.prompts = sampler.draw(self.cap)  # wound back by `batch` to the prompts the step used
        self.seeds = prompt_seeds(key, self.wanted, self.cap)
        self.sent = 0
        self.informative: dict[int, bool] = {}  # prompt index -> whether its group is; filled as groups are scored
        self.lock = threading.Lock()

    def first(self) -> tuple[list[PromptRecord], list[int]]:
        """The prompts to send at once: one batch."""
        self.sent = self.wanted
        return self.prompts[: self.wanted], self.seeds[: self.wanted]

    def scored(self, prompts: list[PromptRecord], completions: list[Completion], scores: list[Score]) -> None:
        """Note which groups of newly scored `completions` (whole groups of `prompts`, numbered as sent) are
        informative."""
        fresh = {c.prompt_index for c in completions}
        indices = sorted(fresh)
        pairs = sorted(zip(completions, scores, strict=True), key=lambda pair: pair[0].prompt_index)
        groups = Rollout(prompts, [c for c, _ in pairs], [score for _, score in pairs])
        rewards, _ = compute_advantages(self.cfg, groups.select_groups([i in fresh for i in range(len(prompts))]))
        with self.lock:
            self.informative.update(zip(indices, informative_groups(rewards, self.group_size).tolist(), strict=True))

    def used(self) -> int | None:
        """How many prompts, from the first, the step trains on; None until that is known."""
        kept = 0
        for index in range(self.sent):
            if index not in self.informative:
                return None
            kept += self.informative[index]
            if kept == self.wanted:
                return index + 1
        return self.sent if self.sent == self.cap else None

    def more(self) -> list[tuple[PromptRecord, int]] | None:
        """Prompts (with seeds) to send now; None once the step has its groups."""
        with self.lock:
            if self.used() is not None:
                return None
            scored, kept = len(self.informative), sum(self.informative.values())
            rate = max((kept + 1) / (scored + 1), 1 / self.cfg.algorithm.max_sampling_rounds)
            expected = math.ceil((self.wanted - kept) / rate)  # prompts under way that should give the rest
            count = min(self.cap - self.sent, max(0, expected - (self.sent - scored)))
            first, self.sent = self.sent, self.sent + count
            return list(zip(self.prompts[first : self.sent], self.seeds[first : self.sent], strict=True))

    def batch(self, rollout: Rollout) -> Rollout:
        """The step's batch from every group generated (`rollout`, numbered as sent); winds the sampler on to just
        after the prompts used. Past the cap with nothing informative, the last batch of groups still makes a
        (zero-advantage) step."""
        used = self.used()
        self.sampler.load_state_dict(self.start)
        self.sampler.draw(used)
        keep = [index < used and self.informative[index] for index in range(len(rollout.prompts))]
        if not any(keep):
            keep = [used - self.wanted <= index < used for index in range(len(rollout.prompts))]
        return rollout.select_groups(keep)

    def metrics(self) -> dict[str, float]:
        """The fraction of the used prompts' groups dropped, the used prompts in batches, and the prompts sent
        past them."""
        used = self.used()
        kept = sum(self.informative[index] for index in range(used))
        return {
            "dynamic_sampling/dropped_fraction": 1 - kept / used,
            "dynamic_sampling/rounds": used / self.wanted,
            "dynamic_sampling/discarded": float(self.sent - used),
        }


def sample_batch(
    cluster: Cluster,
    prompts: list[PromptRecord],
    seeds: list[int],
    group_size: int,
    timer: StepTimer,
    while_generating: Callable[[], None] | None = None,
    refill: Refill | None = None,
) -> Rollout:
    """Generate and score a batch; each generated group is scored while the rest generate (the groups that
    finished while the reward pool was busy go together), so `time/reward` is the scoring left when generation
    ends. `while_generating` runs every few milliseconds while requests are under way. With `refill` the batch
    grows as it asks; the rollout returned holds every prompt sent, numbered as sent, and the groups generated
    before it had enough (a prompt cancelled then has none: `Refill.batch` keeps only prompts it used)."""
    scoring = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scoring")
    waiting: list[Completion] = []  # generated, not yet handed to the reward pool
    lock = threading.Lock()
    batches: list[Future] = []  # each: (completions, their scores)
    sent = list(prompts)  # with `refill`, grows as it sends more

    def score_waiting() -> tuple[list[Completion], list[Score]]:
        with lock:
            batch = waiting.copy()
            waiting.clear()
        scores = cluster.score(score_requests(sent, batch)) if batch else []
        if refill is not None and batch:
            refill.scored(sent[:], batch, scores)  # a copy: `more` may send further prompts meanwhile
        return batch, scores

    def on_group(group: list[Completion]) -> None:
        with lock:
            waiting.extend(group)
        batches.append(scoring.submit(score_waiting))

    def more() -> list[tuple[PromptRecord, int]] | None:
        for batch in batches:  # a group that failed to score (a reward pool past its restarts) is never scored
            if batch.done() and batch.exception() is not None:
                raise batch.exception()
        streamed = refill.more()
        if streamed:
            sent.extend(prompt for prompt, _ in streamed)
        return streamed

    try:
        with timer("generate"):
            completions = cluster.generators.generate(
                prompts, group_size, seeds=seeds, on_group=on_group, while_waiting=while_generating,
                more=None if refill is None else more,
            )  # fmt: skip
        with timer("reward"):
            by_prompt: dict[int, list[Score]] = {}
            for batch in batches:
                for completion, score in zip(*batch.result(), strict=True):
                    by_prompt.setdefault(completion.prompt_index, []).append(score)
    except BaseException:
        scoring.shutdown(wait=True, cancel_futures=True)  # a stop or a failure waits for one batch, not all
        raise
    scoring.shutdown()
    scores = [score for index in sorted(by_prompt) for score in by_prompt[index]]
    return Rollout(sent, completions, scores)


def compute_advantages(cfg: Config, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """Shaped rewards and advantages [B*G]: the weighted reward functions plus DAPO's soft overlong penalty."""
    algo = cfg.algorithm
    per_function = rollout.per_function()  # [B*G, F]
    weights = [spec.weight for spec in cfg.reward.functions]
    if algo.overlong == "soft_penalty":
        penalty = overlong_penalty(
            rollout.lengths(), cfg.rollout.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty
        )  # [B*G]
        per_function, weights = torch.cat([per_function, penalty[:, None]], dim=1), [*weights, 1.0]
    return multi_reward_advantages(
        per_function,
        weights,
        cfg.rollout.group_size,
        combine=cfg.reward.combine,
        estimator=algo.estimator,
        std=algo.std,
        eps=algo.eps,
    )


def score_requests(prompts: list[PromptRecord], completions: list[Completion]) -> list[ScoreRequest]:
    return [ScoreRequest(prompts[c.prompt_index].text, c.text, prompts[c.prompt_index].fields) for c in completions]
