"""How the learner scores a micro-batch (`scores`): the log-prob of each token given those before it, and the entropy
of each next-token distribution, at the sampling temperature. Padded, or packed into one row without padding, with
the sampled tokens' log-probs and entropy taken from the logits a chunk of positions at a time.

Padded (`learner.packing: false`): the micro-batch's rows padded to its longest, logits at every position.

Packing (`learner.packing`, on by default): the micro-batch's sequences are laid end to end, each with its own
position ids from 0, and attention never crosses from one into another: on a GPU in bf16/fp16 by torch's
variable-length flash attention, elsewhere by causal attention over the sequences of each length at once (the
`grpo_packed` attention registered with transformers). Logits are computed only where the next token counts in the
loss (`TrainBatch.completion_mask`): a prompt's positions get none. Scores come back in the batch's padded [b, T]
layout, so the loss and every aggregation read them exactly as they read the padded forward's; positions that do
not count hold 0.

`selected_logprobs` reads the logits in chunks of about `CHUNK_ELEMENTS` entries: the float32 log-softmax of the whole
[positions, vocabulary] block is never held, in the forward or the backward, which recomputes each chunk's
softmax from the logits instead of keeping it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo_dist.algo.batch import TrainBatch

ATTENTION = "grpo_packed"
"""The attention implementation a packed forward runs under (registered by `use_packed_attention`)."""
PASSED_THROUGH = torch.ones(1, 1, 1, 1, dtype=torch.bool)
"""The attention mask of a packed forward: transformers passes a 4D mask to the attention as it is, building none
(which would cost a wait on the device), and the packed attention ignores it."""
CHUNK_ELEMENTS = 1 << 25
"""Logits whose softmax is computed at once (128 MiB in float32: 220 positions of a 151,936-entry vocabulary)."""


@dataclass
class Packed:
    """One micro-batch as one row: the model's inputs and where each scored position goes back."""

    input_ids: torch.Tensor  # [1, N] the sequences end to end
    position_ids: torch.Tensor  # [1, N] from 0 in each sequence
    cu_seq_lens: torch.Tensor  # [b + 1] int32: where each sequence starts, and N
    max_length: int  # the longest sequence
    buckets: list[torch.Tensor]  # per sequence length: [n, L] the positions of its n sequences of that length
    inverse: torch.Tensor  # [N] where each position is among the buckets' positions one after the other
    keep: torch.Tensor  # [K] positions whose next token counts in the loss
    targets: torch.Tensor  # [K] that next token
    rows: torch.Tensor  # [K] its row in the padded layout
    columns: torch.Tensor  # [K] its column there
    shape: tuple[int, int]  # the padded layout [b, T]

    def model_inputs(self) -> dict:
        """Keyword arguments of a Hugging Face causal LM's forward: the packed row, its sequence boundaries (read by
        the attention) and the positions to compute logits at."""
        return {
            "input_ids": self.input_ids,
            "attention_mask": PASSED_THROUGH,  # no mask to build: the attention reads the bounds below
            "position_ids": self.position_ids,
            "cu_seq_lens_q": self.cu_seq_lens,
            "cu_seq_lens_k": self.cu_seq_lens,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
            "packed_buckets": self.buckets,
            "packed_inverse": self.inverse,
            "logits_to_keep": self.keep,
        }

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """[K] values at the kept positions -> [b, T] in the padded layout (0 elsewhere), gradient kept."""
        out = values.new_zeros(self.shape)
        return out.index_put((self.rows, self.columns), values)


def pack(batch: TrainBatch, host: TrainBatch | None = None) -> Packed:
    """The packed form of a right-padded micro-batch. Its layout is worked out on the CPU from the masks of `host`,
    the same micro-batch in host memory where the caller has it (else from one copy of the masks, a wait on the
    device)."""
    device = batch.input_ids.device
    source = host if host is not None else batch
    masks = torch.stack([source.attention_mask.float(), source.completion_mask.float()]).cpu()  # [2, b, T]
    real = masks[0] != 0  # [b, T]; right padding: each row's first L tokens
    counted = (masks[1] != 0) & real  # [b, T] tokens whose log-prob enters the loss
    counted[:, 0] = False  # the first token has no position before it
    lengths = real.sum(dim=1)  # [b]
    starts = F.pad(lengths.cumsum(0), (1, 0))  # [b + 1]
    width = real.shape[1]
    tokens = real.view(-1).nonzero().squeeze(1)  # [N] flat index of each real token, row by row
    rows, columns = counted.nonzero(as_tuple=True)  # [K] each
    by_length: dict[int, list[int]] = {}
    for start, length in zip(starts.tolist(), lengths.tolist(), strict=False):
        by_length.setdefault(length, []).append(start)
    buckets = [torch.tensor(firsts)[:, None] + torch.arange(length) for length, firsts in by_length.items() if length]
    order = torch.cat([bucket.reshape(-1) for bucket in buckets])  # [N]

    def there(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device, non_blocking=True)

    ids = batch.input_ids.reshape(-1)
    return Packed(
        input_ids=ids[there(tokens)][None],
        position_ids=there(tokens % width)[None],
        cu_seq_lens=there(starts.to(torch.int32)),
        max_length=int(lengths.max()),
        buckets=[there(bucket) for bucket in buckets],
        inverse=there(order.argsort()),
        keep=there(starts[rows] + columns - 1),  # the position that predicts the counted token
        targets=ids[there(rows * width + columns)],
        rows=there(rows),
        columns=there(columns),
        shape=tuple(batch.input_ids.shape),
    )


def scores(
    model,
    batch: TrainBatch,
    temperature: float,
    entropy: bool = False,
    packed: bool = True,
    host: TrainBatch | None = None,
    pixels: dict[str, torch.Tensor] | None = None,
    banned: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[b, T] log-probs of `batch`'s tokens under `model` (a Hugging Face causal LM, or a DeepSpeed engine around
    one) and with `entropy` the entropies: packed (only the tokens that count in the loss; 0 elsewhere) or padded.
    `host`: the same micro-batch in host memory, if the caller has it (see `pack`). `pixels`: the rows' image
    tensors a vision-language model reads beside their tokens (padded only). `banned`: token ids the engines never
    sample (a vision-language model's image placeholders), scored out of every distribution as theirs are."""
    if packed:
        if pixels:
            raise ValueError("packed scoring takes no images: a batch with images is scored padded")
        return packed_scores(model, batch, temperature, entropy, host, banned)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **(pixels or {})).logits  # [b,T,V]
    logits = without(logits, banned)
    if entropy:
        return token_logprobs_and_entropy(logits, batch.input_ids, temperature)
    return token_logprobs(logits, batch.input_ids, temperature), None


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, T] logprob of each token given the ones before it, aligned with `input_ids` (position 0 gets 0)."""
    log_probs = _shifted_log_softmax(logits, temperature)  # [B, T-1, V]
    picked = log_probs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    return F.pad(picked, (1, 0))  # [B, T]


def token_logprobs_and_entropy(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and the entropy of each next-token distribution, both [B, T] (position 0 gets 0)."""
    log_probs = _shifted_log_softmax(logits, temperature)  # [B, T-1, V]
    picked = log_probs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    entropy = -(log_probs.exp() * log_probs).sum(-1)  # [B, T-1]
    return F.pad(picked, (1, 0)), F.pad(entropy, (1, 0))  # [B, T] each


def _shifted_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-softmax of the logits predicting tokens 1..T-1, at the sampling temperature. [B, T, V] -> [B, T-1, V]"""
    return F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)


BANNED_LOGIT = -1e4
"""A banned token's logit: probability 0 at any temperature near 1, as the engines' bias of -100 leaves it, and
finite, so that its share of an entropy is 0 rather than NaN."""


def without(logits: torch.Tensor, banned: torch.Tensor | None) -> torch.Tensor:
    """`logits` [..., V] with the `banned` token ids' set to `BANNED_LOGIT` (a copy; as they are without any)."""
    if banned is None or not len(banned):
        return logits
    return logits.index_fill(-1, banned, BANNED_LOGIT)


def packed_scores(
    model,
    batch: TrainBatch,
    temperature: float,
    entropy: bool = False,
    host: TrainBatch | None = None,
    banned: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[b, T] log-probs of the counted tokens of `batch` (and their next-token entropies) from one packed forward
    of `model` (a Hugging Face causal LM, or a DeepSpeed engine around one), 0 at positions that do not count."""
    packed = pack(batch, host)
    logits = without(model(**packed.model_inputs()).logits[0], banned)  # [K, V]
    logprobs, entropies = selected_logprobs(logits, packed.targets, temperature, entropy)
    return packed.unpack(logprobs), None if entropies is None else packed.unpack(entropies)


def selected_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[target] of each row of `logits` [K, V], in float32, and with `entropy` the
    entropy of each row's distribution; both [K], differentiable, computed a chunk of rows at a time."""
    logprobs, entropies = _ChunkedSelection.apply(logits, targets, temperature, entropy)
    return logprobs, entropies if entropy else None


class _ChunkedSelection(torch.autograd.Function):
    """Per row: the target's log-prob and the entropy. Keeps the logits and each row's log-normaliser; the
    backward recomputes the softmax a chunk at a time. With z = logits / t, p = softmax(z) and H = -sum p log p:
    d logp[target] / dz = onehot(target) - p and dH / dz = -p (log p + H), so the gradient of g * logp[target] +
    h * H is g * onehot(target) - p (g + h (log p + H)). Two [chunk, V] float32 buffers at a time."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool):
        picked = torch.empty(len(targets), dtype=torch.float32, device=logits.device)
        normalisers = torch.empty_like(picked)
        entropies = torch.zeros_like(picked)
        for part in _chunks(logits):
            z = logits[part].float() / temperature  # [c, V]
            normalisers[part] = z.logsumexp(dim=-1)
            picked[part] = z.gather(-1, targets[part, None]).squeeze(-1) - normalisers[part]
            if entropy:
                probs = torch.sub(z, normalisers[part, None]).exp_()
                entropies[part] = normalisers[part] - probs.mul_(z).sum(-1)
        ctx.save_for_backward(logits, targets, normalisers, entropies)
        ctx.temperature, ctx.entropy = temperature, entropy
        ctx.mark_non_differentiable(normalisers)
        return picked, entropies

    @staticmethod
    def backward(ctx, grad_picked: torch.Tensor, grad_entropy: torch.Tensor):
        logits, targets, normalisers, entropies = ctx.saved_tensors
        temperature = ctx.temperature
        grad = torch.empty_like(logits)
        for part in _chunks(logits):
            log_probs = torch.sub(logits[part].float(), normalisers[part, None] * temperature).div_(temperature)
            probs = log_probs.exp()  # [c, V]
            weight = grad_picked[part, None]  # [c, 1]: what multiplies p, before the entropy's part
            if ctx.entropy and grad_entropy is not None:
                weight = log_probs.add_(entropies[part, None]).mul_(grad_entropy[part, None]).add_(weight)  # [c, V]
            dz = probs.mul_(weight).neg_()
            dz.scatter_add_(-1, targets[part, None], grad_picked[part, None])
            grad[part] = dz.div_(temperature)
        return grad, None, None, None


def _chunks(logits: torch.Tensor) -> list[slice]:
    """Row ranges of `logits` [K, V] of about `CHUNK_ELEMENTS` entries each."""
    rows = max(1, CHUNK_ELEMENTS // max(1, logits.shape[1]))
    return [slice(start, start + rows) for start in range(0, logits.shape[0], rows)]


def use_packed_attention(model) -> None:
    """Run `model`'s attention as `grpo_packed`: packed forwards (given `cu_seq_lens_q`) attend within each
    sequence; every other forward is transformers' own SDPA attention, with its masks."""
    _register()
    model.set_attn_implementation(ATTENTION)


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTENTION, packed_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # the masks of unpacked forwards


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature: query [1, H, N, D], key and value [1, H_kv, N, D] -> [1, N, H, D].
    Causal within each sequence of `cu_seq_lens_q`; without it, transformers' SDPA attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    varlen = _varlen() if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) else None
    if varlen is not None:
        q, k, v = (tensor[0].transpose(0, 1) for tensor in (query, key, value))  # [N, H, D] each
        out = varlen(q, k, v, bounds, bounds, kwargs["max_length_q"], kwargs["max_length_k"], scale=scaling)
        return out[None], None
    parts = []
    for positions in kwargs["packed_buckets"]:  # the sequences of one length at once: [n, L] positions
        count, length = positions.shape
        q, k, v = (
            tensor[0][:, positions.reshape(-1)].unflatten(1, (count, length)).transpose(0, 1)
            for tensor in (query, key, value)
        )  # [n, H, L, D] each
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)  # [n, H, L, D]
        parts.append(out.transpose(1, 2).flatten(0, 1))  # [n L, H, D]
    return torch.cat(parts)[kwargs["packed_inverse"]][None], None


@functools.cache
def _varlen():
    """torch's variable-length flash attention, causal, where this torch has it (its causal argument moved between
    releases: `is_causal`, then a window of (-1, 0))."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    if "is_causal" in parameters:
        return functools.partial(varlen_attn, is_causal=True)
    if "window_size" in parameters:
        return functools.partial(varlen_attn, window_size=(-1, 0))
    return None
