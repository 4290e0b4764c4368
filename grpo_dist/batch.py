"""The training batch: completions and their advantages, padded into tensors for the learner."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_dist.types import Completion


@dataclass
class TrainBatch:
    """Driver -> learner. B sequences (prompt + completion), right-padded to T tokens."""

    input_ids: torch.Tensor
    """[B, T] token ids, padded with the pad id."""
    attention_mask: torch.Tensor
    """[B, T] 1 on real tokens, 0 on padding."""
    completion_mask: torch.Tensor
    """[B, T] 1 where the token is a sampled completion token that counts in the loss."""
    sampling_logprobs: torch.Tensor
    """[B, T] the generator's logprob of each completion token (0 elsewhere)."""
    advantages: torch.Tensor
    """[B] one advantage per sequence, computed upstream."""
    weight_version: int
    """Policy version that sampled the batch."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch with its tensors on `device`."""
        return self._map(lambda tensor: tensor.to(device))

    def select(self, rows: torch.Tensor | slice) -> TrainBatch:
        """The sub-batch of the given rows (a mini- or micro-batch)."""
        return self._map(lambda tensor: tensor[rows])

    def _map(self, function: Callable[[torch.Tensor], torch.Tensor]) -> TrainBatch:
        """A batch with `function` applied to every tensor field."""
        return TrainBatch(
            input_ids=function(self.input_ids),
            attention_mask=function(self.attention_mask),
            completion_mask=function(self.completion_mask),
            sampling_logprobs=function(self.sampling_logprobs),
            advantages=function(self.advantages),
            weight_version=self.weight_version,
        )


def collate(
    completions: list[Completion], advantages: torch.Tensor, pad_token_id: int, mask_truncated: bool = False
) -> TrainBatch:
    """Pad prompt+completion sequences into one batch; completion tokens are marked for the loss, except those of
    completions cut at the length limit when `mask_truncated` (DAPO's overlong filtering)."""
    if len(completions) != advantages.shape[0]:
        raise ValueError(f"{len(completions)} completions but {advantages.shape[0]} advantages")
    length = max(len(c.prompt_token_ids) + len(c.token_ids) for c in completions)
    batch = len(completions)
    input_ids = torch.full((batch, length), pad_token_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros(batch, length, dtype=torch.long)  # [B, T]
    completion_mask = torch.zeros(batch, length)  # [B, T]
    sampling_logprobs = torch.zeros(batch, length)  # [B, T]
    for row, completion in enumerate(completions):
        start = len(completion.prompt_token_ids)
        end = start + len(completion.token_ids)
        input_ids[row, :end] = torch.tensor(completion.prompt_token_ids + completion.token_ids)
        attention_mask[row, :end] = 1
        completion_mask[row, start:end] = 0.0 if mask_truncated and completion.finish_reason == "length" else 1.0
        sampling_logprobs[row, start:end] = torch.tensor(completion.logprobs)
    versions = {c.weight_version for c in completions}
    return TrainBatch(input_ids, attention_mask, completion_mask, sampling_logprobs, advantages.float(), min(versions))
