"""Splitting a rollout batch across learner ranks: balance by tokens, and loss shares whose gradients add up to the
single-rank gradient of the whole batch for every aggregation (pure torch, no DeepSpeed)."""

from __future__ import annotations

import pytest
import torch
from test_learner import fake_rollout

from grpo_dist.algo import policy_loss
from grpo_dist.algo.batch import TrainBatch, collate, shard_batch
from grpo_dist.algo.loss import AGGREGATIONS


def rollout_batch(groups: int = 3, group_size: int = 4) -> TrainBatch:
    advantages = torch.linspace(-1.0, 1.0, groups * group_size)
    batch = collate(fake_rollout(group_size, groups), advantages, pad_token_id=0)
    batch.completion_mask[1, 4] = 0.0  # one masked completion token, so token and sequence counts differ
    return batch


def loss_of(batch: TrainBatch, logprobs: torch.Tensor, aggregation: str) -> torch.Tensor:
    """The loss of `batch` with `logprobs` [B, T] (old logprobs fixed apart from them: ratios move off 1)."""
    return policy_loss(
        logprobs, logprobs.detach() - 0.1, batch.advantages, batch.completion_mask, aggregation=aggregation,
        max_length=8, clip_low=0.2, clip_high=0.28,
    )[0]  # fmt: skip


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("world_size, mini_batches, micro_batch_size", [(2, 1, 2), (3, 2, 1), (2, 2, 4), (5, 1, 3)])
def test_shard_losses_sum_to_the_whole_batch_gradient(aggregation, world_size, mini_batches, micro_batch_size):
    batch = rollout_batch()
    torch.manual_seed(0)
    logits = torch.randn(batch.input_ids.shape, requires_grad=True)  # stands in for the model: [B, T]
    for index, rows in enumerate(torch.arange(len(batch)).tensor_split(mini_batches)):
        # One rank, mini-batch `index` as one piece: the gradient we must reproduce.
        (expected,) = torch.autograd.grad(loss_of(batch.select(rows), logits[rows], aggregation), logits)
        # Each rank: share x world_size x its micro-batch losses; DeepSpeed then averages over the ranks.
        total = torch.zeros(())
        for shard in shard_batch(batch, world_size, mini_batches, micro_batch_size, aggregation):
            original = shard_rows(batch, shard)
            for micro, share in shard.micro_batches_of(index):
                if share == 0:
                    continue
                length = shard.batch.input_ids.shape[1]
                part = loss_of(shard.batch.select(micro), logits[original[micro], :length], aggregation)
                total = total + part * share * shard.world_size
        (got,) = torch.autograd.grad(total / world_size, logits)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def shard_rows(batch: TrainBatch, shard) -> torch.Tensor:
    """Rows of `batch` that the shard's rows are (matched by their token ids)."""
    length = shard.batch.input_ids.shape[1]
    matches = [
        next(i for i in range(len(batch)) if torch.equal(batch.input_ids[i, :length], row))
        for row in shard.batch.input_ids
    ]
    return torch.tensor(matches)


def test_rows_are_balanced_by_tokens_and_every_rank_runs_the_same_passes():
    batch = rollout_batch()  # sequences of 5, 6 and 7 tokens, four of each
    shards = shard_batch(batch, 2, 1, 2, "token-mean")
    tokens = [int(shard.batch.attention_mask.sum()) for shard in shards]
    assert tokens == [36, 36]  # 72 tokens in all, split evenly
    assert sorted(len(s.mini_batches[0]) for s in shards) == [6, 6]
    assert [len(s.micro_batches[0]) for s in shards] == [3, 3]  # ceil(6 / 2) passes on both ranks
    assert sum(share for s in shards for _, share in s.micro_batches_of(0)) == pytest.approx(1.0)


def test_a_rank_without_rows_runs_placeholder_passes_weighted_zero():
    batch = rollout_batch(groups=1, group_size=2)  # two rows for three ranks
    shards = shard_batch(batch, 3, 1, 4, "seq-mean-token-mean")
    empty = [s for s in shards if not s.mini_batches[0]]
    assert len(empty) == 1
    assert [(rows.tolist(), share) for rows, share in empty[0].micro_batches_of(0)] == [([0], 0.0)]
    assert len(empty[0].batch) == 1
