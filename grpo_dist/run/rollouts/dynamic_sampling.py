"""Dynamic sampling (DAPO, arXiv 2503.14476): a group whose rewards are all equal teaches nothing and is dropped,
and the step's batch is refilled from the stream of prompts until it holds `data.prompts_per_step` groups that do.

`Refill` decides which prompts a step sends and which groups it trains on; `grpo_dist.run.rollouts.collect` sends
them and reports each scored group back. Sampling is seeded per prompt (`prompt_seeds`), so a resumed run draws the
same completions.
"""

from __future__ import annotations

import math
import random
import threading

from grpo_dist.algo import informative_groups
from grpo_dist.config import Config
from grpo_dist.data import PromptRecord, PromptSampler
from grpo_dist.run.rollouts.advantages import compute_advantages
from grpo_dist.run.rollouts.rollout import Rollout
from grpo_dist.types import Completion, Score


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
