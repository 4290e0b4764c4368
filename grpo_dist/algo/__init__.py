"""Algorithm math, torch only: group advantages (GRPO arXiv 2402.03300 and kin) and the clipped policy loss."""

from grpo_dist.algo.advantages import ESTIMATORS, STD_MODES, group_advantages
from grpo_dist.algo.loss import AGGREGATIONS, KL_ESTIMATORS, RATIO_LEVELS, policy_loss

__all__ = [
    "AGGREGATIONS",
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "RATIO_LEVELS",
    "STD_MODES",
    "group_advantages",
    "policy_loss",
]
