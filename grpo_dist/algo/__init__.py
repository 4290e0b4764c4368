"""Algorithm math on tensors: group advantages (GRPO arXiv 2402.03300 and kin), reward shaping, on-policy
distillation's per-token advantages, the policy loss.

Also the learner's batches (`batch`), its log-prob scoring (`scoring`), the compiled CPU ops it loads
(`native_ops`) and the FLOPs of a step (`throughput`). May import: `config` and `types` only."""

from grpo_dist.algo.advantages import ESTIMATORS, STD_MODES, group_advantages
from grpo_dist.algo.distill import distill_advantages, group_baseline, reverse_kl
from grpo_dist.algo.loss import AGGREGATIONS, KL_ESTIMATORS, RATIO_LEVELS, policy_loss
from grpo_dist.algo.shaping import COMBINES, informative_groups, multi_reward_advantages, overlong_penalty

__all__ = [
    "AGGREGATIONS",
    "COMBINES",
    "distill_advantages",
    "group_baseline",
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "RATIO_LEVELS",
    "STD_MODES",
    "group_advantages",
    "informative_groups",
    "multi_reward_advantages",
    "overlong_penalty",
    "policy_loss",
    "reverse_kl",
]
