"""Bounded staleness (`grpo_dist.run.rollouts.staleness`): which groups a step may train on, and when the generators
must sync for the next batch to keep the bound. No actors."""

from __future__ import annotations

import pytest
from rollout_helpers import rollout_of

from grpo_dist.run.rollouts import bound_staleness, sync_due


def test_a_group_holding_one_completion_older_than_k_versions_is_dropped_whole():
    rollout = rollout_of([[5, 5], [4, 3], [3, 5]])
    kept, metrics = bound_staleness(rollout, learner_version=5, k=1)
    assert [c.weight_version for c in kept.completions] == [5, 5]  # the groups holding version 3 are gone
    assert [p.text for p in kept.prompts] == ["p0"]
    assert metrics == {"staleness/dropped": 4.0, "staleness/spanning": 0.0, "staleness/mean": 0.0,
                       "staleness/max": 0.0}  # fmt: skip
    kept, metrics = bound_staleness(rollout, learner_version=5, k=2)
    assert len(kept.completions) == 6
    assert metrics["staleness/max"] == 2.0 and metrics["staleness/dropped"] == 0.0
    assert metrics["staleness/mean"] == pytest.approx((0 + 0 + 1 + 2 + 2 + 0) / 6)


def test_a_completion_spanning_versions_is_as_old_as_its_oldest_token():
    # Group 0 holds tokens of version 3, 2 updates old at 5: dropped. Group 1 (4 -> 5, and 4) is 1 update old.
    rollout = rollout_of([[(3, 5), 5], [(4, 5), 4]])
    kept, metrics = bound_staleness(rollout, learner_version=5, k=1)
    assert [p.text for p in kept.prompts] == ["p1"]
    assert metrics == {"staleness/dropped": 2.0, "staleness/spanning": 1.0, "staleness/mean": 1.0,
                       "staleness/max": 1.0}  # fmt: skip


@pytest.mark.parametrize(
    ("k", "generator_version", "learner_version", "due"),
    [
        (0, 4, 5, True),  # on-policy: the next batch needs the learner's weights
        (1, 4, 5, True),  # drawn ahead, trained one update later: 6 - 4 would be 2
        (2, 4, 5, False),  # 6 - 4 = 2 is within the bound
        (2, 3, 5, True),
        (3, 3, 5, False),
    ],
)
def test_a_sync_is_due_only_when_the_next_batch_would_break_the_bound(k, generator_version, learner_version, due):
    assert sync_due(k, generator_version, learner_version) is due
