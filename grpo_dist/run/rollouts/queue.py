"""The batch each step trains on: generated and scored when the step begins (k = `rollout.max_staleness` = 0,
on-policy), or drawn one step ahead, while the learner trains on the current one (k >= 1), and with it the run's
place in the prompt stream that a checkpoint keeps."""

from __future__ import annotations

from grpo_dist.algo.throughput import StepTimer
from grpo_dist.cluster.cluster import Cluster
from grpo_dist.config import Config
from grpo_dist.data import PromptSampler
from grpo_dist.run.rollouts.collect import collect_rollout
from grpo_dist.run.rollouts.rollout import Rollout


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
        return collect_rollout(self.cfg, self.cluster, self.sampler, timer, step)

    def draw_ahead(self, step: int, timer: StepTimer) -> None:
        """With k >= 1, generate and score step `step`'s batch now (while the learner trains on the current one);
        with `sync.mode: in_flight` the generators get the new weights as soon as that training step ends."""
        cfg = self.cfg
        if cfg.rollout.max_staleness == 0 or step > cfg.run.steps:
            return
        before = self.sampler.state_dict()
        in_flight = cfg.sync.mode == "in_flight"
        rollout, metrics = collect_rollout(cfg, self.cluster, self.sampler, timer, step, in_flight)
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
            print(
                "the checkpoint's batch drawn ahead was sampled or scored under other settings (rewards, batch "
                "size, sampling): its prompts are drawn again"
            )
        elif ahead and self.cfg.rollout.max_staleness >= 1 and ahead["batch"][0] == step + 1:
            self.sampler.load_state_dict(ahead["sampler"])
            self.ahead, self.sampler_before_ahead = ahead["batch"], state["sampler"]
            return
        self.sampler.load_state_dict(state["sampler"])

    def queued_prompts(self) -> int:
        return len(self.ahead[1].prompts) if self.ahead is not None else 0

    def put_back_ahead(self) -> None:
        """Forget the batch drawn ahead and put its prompts back: the sampler stands past the batches taken only (a
        rollback skips those, and draws the next batch afresh from the restored weights)."""
        if self.ahead is not None:
            self.sampler.load_state_dict(self.sampler_before_ahead)
        self.reset()

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
        **({"algorithm.distill": algo.distill.model_dump(mode="json")} if algo.distill is not None else {}),
    }
