"""How the learner scores a micro-batch (`scores`): the log-prob of each token given those before it, and the entropy
of each next-token distribution, at the sampling temperature. Padded, or packed into one row without padding, with
the sampled tokens' log-probs and entropy taken from the logits a chunk of positions at a time.

Padded (`learner.packing: false`): the micro-batch's rows padded to its longest, logits at every position.

Packing (`learner.packing`, on by default): the micro-batch's sequences are laid end to end, each with its own
position ids from 0, and attention never crosses from one into another: on a GPU in bf16/fp16 by torch's
variable-length flash attention, elsewhere by causal attention over the sequences of each shape at once (the
`grpo_packed` attention registered with transformers). Logits are computed only where the next token counts in the
loss (`TrainBatch.completion_mask`): a prompt's positions get none. Scores come back in the batch's padded [b, T]
layout, so the loss and every aggregation read them exactly as they read the padded forward's; positions that do
not count hold 0.

Shared prompts (packing on a CPU, where every layer attends: `shares_prompts`): a group's G rows begin with the
same prompt, whose tokens see only each other, so their keys, values and hidden states are the same in every row.
The packed row holds such a prompt once, each row's own tokens following it with the positions they have in the
row; those attend to the prompt and causally to each other (`Layout`). Every token sees exactly what it sees in its
own row, so the scores and gradients are the unshared ones (the prompt's gradient is the sum of its rows'), from
fewer tokens: a group of 16 short answers to a 9-token prompt is 41 tokens, not 176.

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

    input_ids: torch.Tensor  # [1, N] the segments end to end
    position_ids: torch.Tensor  # [1, N] each token's position in its own sequence
    cu_seq_lens: torch.Tensor  # [s + 1] int32: where each segment starts, and N
    max_length: int  # the longest segment
    blocks: list[tuple[torch.Tensor, torch.Tensor | None]]  # attention a block at a time (`Layout.blocks`)
    inverse: torch.Tensor  # [N] where each position is among the blocks' queries one after the other
    keep: torch.Tensor  # [K] positions whose next token counts in the loss
    targets: torch.Tensor  # [K] that next token
    rows: torch.Tensor  # [K] its row in the padded layout
    columns: torch.Tensor  # [K] its column there
    shape: tuple[int, int]  # the padded layout [b, T]
    shared: bool  # whether rows with one prompt share its tokens (no variable-length attention then)

    def model_inputs(self) -> dict:
        """Keyword arguments of a Hugging Face causal LM's forward: the packed row, its segments' bounds (read by
        the attention) and the positions to compute logits at."""
        return {
            "input_ids": self.input_ids,
            "attention_mask": PASSED_THROUGH,  # no mask to build: the attention reads the bounds below
            "position_ids": self.position_ids,
            "cu_seq_lens_q": self.cu_seq_lens,
            "cu_seq_lens_k": self.cu_seq_lens,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
            "packed_blocks": self.blocks,
            "packed_inverse": self.inverse,
            "packed_shared": self.shared,
            "logits_to_keep": self.keep,
        }

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """[K] values at the kept positions -> [b, T] in the padded layout (0 elsewhere), gradient kept."""
        out = values.new_zeros(self.shape)
        return out.index_put((self.rows, self.columns), values)


class Layout:
    """Where each row's tokens go in the packed row, worked out on the CPU. A row's prompt is its tokens before its
    first counted one; rows given together (a group's, whose prompts are equal) keep one copy of it, each row's own
    tokens following it. Attention runs a block at a time, blocks of one shape together: a block's queries are one
    sequence's tokens (a whole row, or a shared prompt) attending causally among themselves, or one row's own
    tokens after a shared prompt, attending to the prompt and causally among themselves."""

    def __init__(self, rows: int, width: int):
        self.width = width  # the padded layout's T
        self.sources: list[int] = []  # [N] the padded layout's flat index of each packed token
        self.starts = [0]  # where each segment starts in the packed row, and its end
        self.prompt_at = [0] * rows  # [b] where each row's prompt starts
        self.prompt = [0] * rows  # [b] its length
        self.own_at = [0] * rows  # [b] where the row's own tokens after it start
        self.by_shape: dict[tuple[int, int], tuple[list[int], list[int]]] = {}  # (Lq, Lk) -> queries, keys

    def add(self, rows: list[int], prompt: int, lengths: list[int]) -> None:
        """One segment: `rows` sharing their first `prompt` tokens (a row alone: all of it is its prompt)."""
        start, first = len(self.sources), rows[0] * self.width
        if len(rows) == 1:
            prompt = lengths[0]
        self.sources.extend(range(first, first + prompt))
        self._block(range(start, start + prompt))
        for row, length in zip(rows, lengths, strict=True):
            end = len(self.sources)
            self.prompt_at[row], self.prompt[row], self.own_at[row] = start, prompt, end
            if length > prompt:
                self.sources.extend(range(row * self.width + prompt, row * self.width + length))
                self._block(range(end, end + length - prompt), range(start, start + prompt))
        self.starts.append(len(self.sources))

    def _block(self, queries: range, prompt: range = range(0)) -> None:
        found = self.by_shape.setdefault((len(queries), len(prompt) + len(queries)), ([], []))
        found[0].extend(queries)
        if prompt:
            found[1].extend(prompt)
            found[1].extend(queries)

    def positions(self, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """[K] the packed positions of the tokens at (`rows`, `columns`) of the padded layout, [K] each."""
        prompt = torch.tensor(self.prompt)[rows]
        in_prompt = torch.tensor(self.prompt_at)[rows] + columns
        return torch.where(columns < prompt, in_prompt, torch.tensor(self.own_at)[rows] + columns - prompt)

    def blocks(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Per shape: [n, Lq] the queries' positions and [n, Lk] their keys' (None: the queries themselves)."""
        return [
            (torch.tensor(queries).view(-1, length), None if length == seen else torch.tensor(keys).view(-1, seen))
            for (length, seen), (queries, keys) in self.by_shape.items()
        ]


def pack(batch: TrainBatch, host: TrainBatch | None = None, share: bool = True) -> Packed:
    """The packed form of a right-padded micro-batch. Its layout is worked out on the CPU from `host`, the same
    micro-batch in host memory where the caller has it (else from a copy of its masks and ids, a wait on the
    device). With `share`, rows with one prompt (a group's) share its tokens: the same scores from fewer tokens."""
    device = batch.input_ids.device
    source = host if host is not None else batch
    real = source.attention_mask.cpu() != 0  # [b, T]; right padding: each row's first L tokens
    counted = (source.completion_mask.cpu() != 0) & real  # [b, T] tokens whose log-prob enters the loss
    counted[:, 0] = False  # the first token has no position before it
    lengths = real.sum(dim=1)  # [b]
    prompts = torch.where(counted.any(dim=1), counted.int().argmax(dim=1), lengths).tolist()  # [b]
    segments: dict[bytes | int, list[int]] = {}
    ids = source.input_ids.cpu() if share else None
    for row, length in enumerate(lengths.tolist()):
        if length:
            key = ids[row, : prompts[row]].numpy().tobytes() if share else row
            segments.setdefault(key, []).append(row)
    width = real.shape[1]
    layout = Layout(len(lengths), width)
    for rows in segments.values():
        layout.add(rows, prompts[rows[0]], lengths[rows].tolist())
    rows, columns = counted.nonzero(as_tuple=True)  # [K] each
    blocks = layout.blocks()
    order = torch.cat([queries.reshape(-1) for queries, _ in blocks])  # [N]
    flat = torch.tensor(layout.sources, dtype=torch.long)  # [N]

    def there(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(device, non_blocking=True)

    starts = torch.tensor(layout.starts)
    padded_ids = batch.input_ids.reshape(-1)
    return Packed(
        input_ids=padded_ids[there(flat)][None],
        position_ids=there(flat % width)[None],
        cu_seq_lens=there(starts.to(torch.int32)),
        max_length=int((starts[1:] - starts[:-1]).max()),
        blocks=[(there(queries), there(keys)) for queries, keys in blocks],
        inverse=there(order.argsort()),
        keep=there(layout.positions(rows, columns - 1)),  # the position that predicts the counted token
        targets=padded_ids[there(rows * width + columns)],
        rows=there(rows),
        columns=there(columns),
        shape=tuple(batch.input_ids.shape),
        shared=share,
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
    share: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[b, T] log-probs of `batch`'s tokens under `model` (a Hugging Face causal LM, or a DeepSpeed engine around
    one) and with `entropy` the entropies: packed (only the tokens that count in the loss; 0 elsewhere) or padded.
    `host`: the same micro-batch in host memory, if the caller has it (see `pack`). `pixels`: the rows' image
    tensors a vision-language model reads beside their tokens (padded only). `banned`: token ids the engines never
    sample (a vision-language model's image placeholders), scored out of every distribution as theirs are.
    `share`: whether packed rows with one prompt share its tokens (`shares_prompts`; None: on a CPU)."""
    if packed:
        if pixels:
            raise ValueError("packed scoring takes no images: a batch with images is scored padded")
        return packed_scores(model, batch, temperature, entropy, host, banned, share)
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
    share: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[b, T] log-probs of the counted tokens of `batch` (and their next-token entropies) from one packed forward
    of `model` (a Hugging Face causal LM, or a DeepSpeed engine around one), 0 at positions that do not count.
    `share`: whether rows with one prompt share its tokens (`shares_prompts`; None: on a CPU)."""
    packed = pack(batch, host, shares_prompts(batch.input_ids.device) if share is None else share)
    logits = without(model(**packed.model_inputs()).logits[0], banned)  # [K, V]
    logprobs, entropies = selected_logprobs(logits, packed.targets, temperature, entropy)
    return packed.unpack(logprobs), None if entropies is None else packed.unpack(entropies)


def shares_prompts(device: torch.device, config=None) -> bool:
    """Whether a packed forward on `device` of a model with `config` (its text config; None: one whose every layer
    attends) shares a group's prompt among its rows: on a CPU (on a GPU torch's variable-length attention takes
    whole sequences), where every layer attends (a recurrent layer, as a hybrid model's linear attention, reads the
    segments' bounds as sequences)."""
    kinds = getattr(config, "layer_types", None) or []
    return device.type != "cuda" and all(kind in ("full_attention", "sliding_attention") for kind in kinds)


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
    Packed (given `cu_seq_lens_q`): each token sees what it sees in its own row (`Layout`); without it,
    transformers' SDPA attention."""
    from torch.nn.attention.bias import causal_lower_right
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    half = query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)
    varlen = _varlen() if half and not kwargs["packed_shared"] else None
    if varlen is not None:
        q, k, v = (tensor[0].transpose(0, 1) for tensor in (query, key, value))  # [N, H, D] each
        out = varlen(q, k, v, bounds, bounds, kwargs["max_length_q"], kwargs["max_length_k"], scale=scaling)
        return out[None], None

    def gathered(tensor: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [1, H, N, D] -> [n, H, L, D]
        return tensor[0][:, positions.reshape(-1)].unflatten(1, positions.shape).transpose(0, 1)

    parts = []
    for queries, keys in kwargs["packed_blocks"]:  # [n, Lq] positions, and [n, Lk] their keys' (None: the same)
        q = gathered(query, queries)
        if keys is None:  # a sequence's tokens among themselves
            out = F.scaled_dot_product_attention(q, gathered(key, queries), gathered(value, queries), is_causal=True,
                                                 scale=scaling)  # fmt: skip
        else:  # a row's own tokens after its shared prompt: every prompt token, then causally its own
            visible = causal_lower_right(queries.shape[1], keys.shape[1])  # no [Lq, Lk] mask held
            out = F.scaled_dot_product_attention(q, gathered(key, keys), gathered(value, keys), attn_mask=visible,
                                                 scale=scaling)  # fmt: skip
        parts.append(out.transpose(1, 2).flatten(0, 1))  # [n Lq, H, D]
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
