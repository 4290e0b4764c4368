"""The batch drawn ahead (`grpo_dist.run.rollouts.queue`) and its place in a checkpoint. No actors."""

from __future__ import annotations

from conftest import small_config
from rollout_helpers import rollout_of

from grpo_dist.config import validate_config
from grpo_dist.data import PromptRecord, PromptSampler
from grpo_dist.run.rollouts import RolloutQueue


def test_a_checkpoint_holds_the_batch_drawn_ahead_and_a_run_resumed_on_policy_draws_its_prompts_again(tmp_path, capsys):
    def queue(k: int) -> RolloutQueue:
        records = [PromptRecord(str(i), [1], {}) for i in range(40)]
        return RolloutQueue(validate_config(small_config(tmp_path, rollout={"max_staleness": k})), None,
                            PromptSampler(records, 4, seed=0))  # fmt: skip

    run = queue(1)
    before = run.sampler.state_dict()
    run.sampler.draw(4)  # the prompts of step 4's batch, drawn ahead while step 3 trained
    run.ahead, run.sampler_before_ahead = (4, rollout_of([[2], [2], [2], [2]]), {"sync/in_flight": 0.0}), before
    state = run.state_dict()
    resumed = queue(1)
    resumed.load_state_dict(state, step=3)
    assert resumed.ahead == run.ahead and (resumed.sampler.epoch, resumed.sampler.state_dict()["position"]) == (0, 4)
    assert resumed.state_dict() == state  # checkpointed again before step 4, it holds the same
    for k, step in [(0, 3), (1, 5)]:  # resumed on-policy, or from another step: the prompts are drawn again
        other = queue(k)
        other.load_state_dict(state, step=step)
        assert other.ahead is None and (other.sampler.epoch, other.sampler.state_dict()["position"]) == (0, 0)
    rescored = queue(1)  # resumed with another reward: the batch was scored by the old one
    rescored.cfg.reward.functions[0].weight = 2.0
    rescored.load_state_dict(state, step=3)
    assert rescored.ahead is None and (rescored.sampler.epoch, rescored.sampler.state_dict()["position"]) == (0, 0)
    assert "drawn again" in capsys.readouterr().out
    older = queue(1)  # a checkpoint written before batches drawn ahead were kept
    older.load_state_dict({"sampler": {"epoch": 0, "position": 8}}, step=3)
    assert older.ahead is None and (older.sampler.epoch, older.sampler.state_dict()["position"]) == (0, 8)
