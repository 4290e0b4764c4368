"""The training batch: completions and their advantages, padded into tensors for the learner."""

from __future__ import annotations

import dataclasses
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
    token_advantages: torch.Tensor | None = None
    """[B, T] per-token advantages added to each row's (on-policy distillation's, `with_token_advantages`); None:
    none."""
    images: list[tuple[bytes, ...]] | None = None
    """[B] each row's prompt's images (PNG bytes), whose tokens its `input_ids` hold: the learner's forward reads
    their pixels (`grpo_dist.models.vision`); None: no row has any."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch with its tensors on `device`."""
        return self._map(lambda tensor: tensor.to(device))

    def select(self, rows: torch.Tensor | slice) -> TrainBatch:
        """The sub-batch of the given rows (a mini- or micro-batch)."""
        chosen = self._map(lambda tensor: tensor[rows])
        if self.images is not None:
            picked = range(len(self))[rows] if isinstance(rows, slice) else rows.reshape(-1).tolist()
            chosen.images = [self.images[row] for row in picked]
        return chosen

    def trimmed(self) -> TrainBatch:
        """The same rows cut to their longest sequence (right padding beyond it dropped)."""
        length = int(self.attention_mask.sum(dim=1).max())
        return self._map(lambda tensor: tensor[:, :length] if tensor.dim() == 2 else tensor)

    def _map(self, function: Callable[[torch.Tensor], torch.Tensor]) -> TrainBatch:
        """A batch with `function` applied to every tensor field."""
        return TrainBatch(
            input_ids=function(self.input_ids),
            attention_mask=function(self.attention_mask),
            completion_mask=function(self.completion_mask),
            sampling_logprobs=function(self.sampling_logprobs),
            advantages=function(self.advantages),
            weight_version=self.weight_version,
            token_advantages=None if self.token_advantages is None else function(self.token_advantages),
            images=self.images,
        )

    def with_token_advantages(self, token_advantages: torch.Tensor) -> TrainBatch:
        """The same batch with per-token advantages [B, T] added to its rows' (on-policy distillation's)."""
        if token_advantages.shape != self.input_ids.shape:
            raise ValueError(
                f"token advantages {tuple(token_advantages.shape)} do not match the batch {tuple(self.input_ids.shape)}"
            )
        return dataclasses.replace(self, token_advantages=token_advantages.float())


def collate(
    completions: list[Completion],
    advantages: torch.Tensor,
    pad_token_id: int,
    mask_truncated: bool = False,
    images: list[tuple[bytes, ...]] | None = None,
) -> TrainBatch:
    """Pad prompt+completion sequences into one batch; completion tokens are marked for the loss (of a multi-turn
    trajectory, only those the model sampled: its `mask`), except those of completions cut at the length limit
    when `mask_truncated` (DAPO's overlong filtering). `images`: each completion's prompt's images, or None."""
    if len(completions) != advantages.shape[0]:
        raise ValueError(f"{len(completions)} completions but {advantages.shape[0]} advantages")
    length = max(len(c.prompt_token_ids) + len(c.token_ids) for c in completions)
    # The rows padded as lists and each field made one tensor, not four small tensors a row (a step has hundreds).
    ids, attended, masked, logprobs = [], [], [], []
    for completion in completions:
        prompt, sampled = len(completion.prompt_token_ids), len(completion.token_ids)
        pad = length - prompt - sampled
        ids.append(completion.prompt_token_ids + completion.token_ids + [pad_token_id] * pad)
        attended.append([1] * (prompt + sampled) + [0] * pad)
        if mask_truncated and completion.finish_reason == "length":
            loss = [0.0] * sampled
        else:
            loss = [1.0] * sampled if completion.mask is None else [float(m) for m in completion.mask]
        masked.append([0.0] * prompt + loss + [0.0] * pad)
        logprobs.append([0.0] * prompt + [float(p) for p in completion.logprobs] + [0.0] * pad)
    input_ids = torch.tensor(ids, dtype=torch.long)  # [B, T]
    attention_mask = torch.tensor(attended, dtype=torch.long)  # [B, T]
    completion_mask = torch.tensor(masked)  # [B, T]
    sampling_logprobs = torch.tensor(logprobs)  # [B, T]
    versions = {c.weight_version for c in completions}
    return TrainBatch(
        input_ids, attention_mask, completion_mask, sampling_logprobs, advantages.float(), min(versions), images=images
    )


@dataclass
class TrainShard:
    """Learner group -> one learner rank: its rows of a rollout batch and how to weight their losses so the
    gradients summed over the ranks equal the single-rank gradient of the whole batch."""

    batch: TrainBatch
    """[b, T'] this rank's rows, trimmed to their longest sequence (row 0 of the whole batch, with no mini-batch
    holding it, when the rank has no rows: it still runs every collective)."""
    mini_batches: list[list[int]]
    """Per global mini-batch, this rank's rows of it (indices into `batch`); may be empty."""
    mini_batch_units: list[float]
    """Per mini-batch, its loss normaliser over all ranks: completion tokens (token-mean) or sequences."""
    micro_batches: list[list[list[int]]]
    """Per mini-batch, the rows of each of its micro-batches (indices into `batch`; a micro-batch may be empty).
    Every rank has as many micro-batches in each mini-batch, since forwards are collective under ZeRO-3."""
    world_size: int
    """Number of learner ranks; DeepSpeed averages gradients over them, so each rank's loss is scaled by it."""
    aggregation: str
    """The loss aggregation, which decides what a row weighs (see `loss_units`)."""

    def micro_batches_of(self, index: int) -> list[tuple[torch.Tensor, float]]:
        """(rows, share) of each micro-batch of mini-batch `index`: the rows of `batch` it holds (a placeholder
        row 0 when it holds none) and its share of the whole mini-batch's loss over all ranks (0 for a
        placeholder). Summed over ranks, share x the micro-batch's aggregated loss is the mini-batch's loss."""
        units = loss_units(self.batch, self.aggregation)  # [b]
        parts = []
        for rows in self.micro_batches[index]:
            micro = torch.tensor(rows, dtype=torch.long)
            share = float(units[micro].sum()) / max(self.mini_batch_units[index], 1e-12)
            parts.append((micro if rows else torch.tensor([0]), share))
        return parts


def loss_units(batch: TrainBatch, aggregation: str) -> torch.Tensor:
    """[B] what each row contributes to its mini-batch's loss normaliser: its counted completion tokens for
    `token-mean`, one sequence for the sequence-mean aggregations."""
    if aggregation == "token-mean":
        return batch.completion_mask.sum(dim=1)
    return torch.ones(len(batch))


def shard_batch(
    batch: TrainBatch,
    world_size: int,
    mini_batches: int,
    micro_batch_size: int,
    aggregation: str,
    max_tokens: int | None = None,
) -> list[TrainShard]:
    """Cut a rollout batch into one shard per rank. Mini-batches are contiguous row ranges (as on one rank);
    within each, rows go to ranks balanced by token count (longest first, to the least-loaded rank). Each rank's
    rows of a mini-batch form micro-batches of `micro_batch_size` rows, or with `max_tokens` of at most that many
    tokens (`token_budget_micro_batches`); a rank with fewer micro-batches than another splits its largest."""
    units, tokens = loss_units(batch, aggregation), batch.attention_mask.sum(dim=1).tolist()  # [B] each
    rows_of = [[[] for _ in range(mini_batches)] for _ in range(world_size)]  # [rank][mini-batch] -> rows
    for index, rows in enumerate(torch.arange(len(batch)).tensor_split(min(mini_batches, len(batch)))):
        load = [0] * world_size
        for row in sorted(rows.tolist(), key=lambda r: -tokens[r]):
            rank = load.index(min(load))
            rows_of[rank][index].append(row)
            load[rank] += tokens[row]
    used = min(mini_batches, len(batch))
    mini_batch_units = [sum(float(units[r]) for rank in rows_of for r in rank[m]) for m in range(used)]
    micro = [[[] for _ in range(used)] for _ in range(world_size)]  # [rank][mini-batch] -> micro-batches of rows
    for m in range(used):
        if max_tokens is None:
            count = max(1, max(-(-len(rank[m]) // micro_batch_size) for rank in rows_of))  # ceil division
            for rank in range(world_size):
                micro[rank][m] = [part.tolist() for part in torch.tensor(rows_of[rank][m]).tensor_split(count)]
        else:
            for rank in range(world_size):
                micro[rank][m] = token_budget_micro_batches(rows_of[rank][m], tokens, max_tokens)
            count = max(len(micro[rank][m]) for rank in range(world_size))
            for rank in range(world_size):
                micro[rank][m] = even_out(micro[rank][m], count, tokens)
    common = {"mini_batch_units": mini_batch_units, "world_size": world_size, "aggregation": aggregation}
    return [_shard(batch, rows_of[rank][:used], micro[rank], common) for rank in range(world_size)]


def token_budget_micro_batches(rows: list[int], tokens: list[int], budget: int) -> list[list[int]]:
    """`rows` in micro-batches of at most `budget` tokens (`tokens[row]` each; a longer row alone): longest first,
    each into the first micro-batch it fits. At least one micro-batch, perhaps empty."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for row in sorted(rows, key=lambda r: -tokens[r]):
        fits = next((i for i, load in enumerate(loads) if load + tokens[row] <= budget), None)
        if fits is None:
            bins.append([row])
            loads.append(tokens[row])
        else:
            bins[fits].append(row)
            loads[fits] += tokens[row]
    return [sorted(rows) for rows in bins] or [[]]


def even_out(bins: list[list[int]], count: int, tokens: list[int]) -> list[list[int]]:
    """`bins` made `count` micro-batches: the one with the most tokens among those of several rows split in two
    (each half the lighter), until there are `count`; empty ones added when no micro-batch has two rows."""
    bins = [list(rows) for rows in bins if rows]
    while len(bins) < count:
        splittable = [i for i, rows in enumerate(bins) if len(rows) > 1]
        if not splittable:
            bins.append([])
            continue
        largest = bins.pop(max(splittable, key=lambda i: sum(tokens[r] for r in bins[i])))
        halves: list[list[int]] = [[], []]
        for row in sorted(largest, key=lambda r: -tokens[r]):
            min(halves, key=lambda half: sum(tokens[r] for r in half)).append(row)
        bins.extend(sorted(half) for half in halves)
    return bins


def _shard(batch: TrainBatch, rows: list[list[int]], micro: list[list[list[int]]], common: dict) -> TrainShard:
    """One rank's shard: its rows gathered in mini-batch order, with their indices in the shard."""
    flat = [row for mini in rows for row in mini]
    if not flat:  # no rows for this rank: it runs the same forwards on a placeholder row, weighted 0
        empty = [[[] for _ in parts] for parts in micro]
        return TrainShard(batch.select(slice(0, 1)), [[] for _ in rows], micro_batches=empty, **common)
    local = {row: index for index, row in enumerate(flat)}
    mini_batches = [[local[row] for row in mini] for mini in rows]
    micro_batches = [[[local[row] for row in part] for part in parts] for parts in micro]
    return TrainShard(batch.select(torch.tensor(flat)).trimmed(), mini_batches, micro_batches=micro_batches, **common)
