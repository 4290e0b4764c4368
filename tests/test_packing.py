"""Packed micro-batches (`grpo_dist.algo.scoring`) against the padded forward on the tiny model, in this process: the
same loss for every aggregation, with the KL, entropy and importance weights, and the same gradients, whether each
row is its own sequence or a group's rows share their prompt's tokens; chunked log-prob selection against the full
log-softmax; micro-batches by a token budget, balanced over the ranks."""

from __future__ import annotations

import pytest
import torch
from conftest import small_config
from test_shard import loss_of, rollout_batch, shard_rows

from grpo_dist.algo import policy_loss, scoring
from grpo_dist.algo.batch import TrainBatch, shard_batch, token_budget_micro_batches
from grpo_dist.algo.loss import AGGREGATIONS
from grpo_dist.algo.scoring import token_logprobs, token_logprobs_and_entropy
from grpo_dist.config import ConfigError, validate_config


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from grpo_dist.models import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("model"), num_layers=2)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    scoring.use_packed_attention(policy)
    return policy


def ragged_batch(lengths=(40, 7, 23, 1, 23, 12, 7), prompt=5) -> TrainBatch:
    """Right-padded rows of the given lengths (some alike: attended together); completions from token `prompt` on,
    with a hole in one (a tool's observation in a multi-turn trajectory) and one row with no completion token."""
    generator = torch.Generator().manual_seed(0)
    rows, length = len(lengths), max(lengths)
    input_ids = torch.randint(3, 60, (rows, length), generator=generator)
    attention_mask, completion_mask = torch.zeros(rows, length, dtype=torch.long), torch.zeros(rows, length)
    for row, used in enumerate(lengths):
        input_ids[row, used:] = 0
        attention_mask[row, :used] = 1
        completion_mask[row, min(prompt, used) : used] = 1.0
    completion_mask[0, 12:20] = 0.0  # an observation inside a trajectory
    sampling = torch.randn(rows, length, generator=generator) * 0.1 - 2.0
    advantages = torch.linspace(-1.0, 1.0, rows)
    return TrainBatch(input_ids, attention_mask, completion_mask, sampling * completion_mask, advantages, 0)


def grouped_batch() -> TrainBatch:
    """Three groups' rows, interleaved: prompts of 6, 9 and 6 tokens (the two of 6 different), each row's completion
    its own length after it; a trajectory with an observation inside, a row with no counted token (its whole text
    a prompt no other row has), and a row that is its group's prompt and one token."""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 60, (length,), generator=generator) for length in (6, 9, 6)]
    completions = [(0, 7), (1, 3), (2, 5), (0, 1), (1, 12), (2, 5), (0, 4), (1, 6), (2, 9)]  # (group, its length)
    rows, width = len(completions) + 1, 9 + 12
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    attention_mask, completion_mask = torch.zeros(rows, width, dtype=torch.long), torch.zeros(rows, width)
    for row, (group, length) in enumerate(completions):
        prompt = prompts[group]
        input_ids[row, : len(prompt)] = prompt
        input_ids[row, len(prompt) : len(prompt) + length] = torch.randint(3, 60, (length,), generator=generator)
        attention_mask[row, : len(prompt) + length] = 1
        completion_mask[row, len(prompt) : len(prompt) + length] = 1.0
    completion_mask[4, 12:15] = 0.0  # an observation inside a trajectory
    input_ids[-1, :8] = torch.randint(3, 60, (8,), generator=generator)  # nothing counted: a prompt alone
    attention_mask[-1, :8] = 1
    sampling = torch.randn(rows, width, generator=generator) * 0.1 - 2.0
    advantages = torch.linspace(-1.0, 1.0, rows)
    return TrainBatch(input_ids, attention_mask, completion_mask, sampling * completion_mask, advantages, 0)


def padded_scores(model, batch: TrainBatch, temperature: float):
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return token_logprobs_and_entropy(logits, batch.input_ids, temperature)


def full_loss(batch: TrainBatch, logprobs, entropy, reference, aggregation: str):
    return policy_loss(
        logprobs, logprobs.detach() - 0.05, batch.advantages, batch.completion_mask, aggregation=aggregation,
        max_length=40, clip_low=0.2, clip_high=0.28, ref_logprobs=reference, kl_coef=0.1,
        sampling_logprobs=batch.sampling_logprobs, is_cap=2.0, entropy=entropy, entropy_coef=0.01,
    )  # fmt: skip


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("rows", [ragged_batch, grouped_batch], ids=["own prompts", "shared prompts"])
def test_packed_loss_and_gradients_equal_the_padded_ones(model, aggregation, rows):
    batch, temperature = rows(), 0.7
    with torch.no_grad():
        reference = token_logprobs(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits,
                                   batch.input_ids, temperature) - 0.02  # fmt: skip
    results = []
    for scores in (padded_scores, lambda m, b, t: scoring.packed_scores(m, b, t, entropy=True)):
        model.zero_grad()
        logprobs, entropy = scores(model, batch, temperature)
        loss, metrics = full_loss(batch, logprobs, entropy, reference, aggregation)
        loss.backward()
        grads = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
        results.append((loss.item(), metrics, grads))
    (padded, padded_metrics, padded_grads), (packed, packed_metrics, packed_grads) = results
    assert packed == pytest.approx(padded, rel=1e-5, abs=1e-7)
    for key in ("kl", "entropy", "clip_fraction", "is_weight/mean", "ratio/mean"):
        assert packed_metrics[key] == pytest.approx(padded_metrics[key], rel=1e-5, abs=1e-7), key
    assert max(grad.abs().max() for grad in padded_grads.values()) > 1e-3  # the loss moves the weights
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_a_packed_sequence_sees_nothing_of_its_neighbours(model):
    batch = ragged_batch()
    changed = ragged_batch()
    changed.input_ids[1, :7] = torch.randint(3, 60, (7,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = scoring.packed_scores(model, batch, 1.0)[0]
        after = scoring.packed_scores(model, changed, 1.0)[0]
    others = [0, 2, 3, 4, 5, 6]  # row 6 has row 1's length: their attention runs together
    torch.testing.assert_close(after[others], before[others], atol=1e-6, rtol=0)
    assert not torch.allclose(after[1], before[1])  # the row that changed scores differently


def test_logits_are_computed_only_where_the_next_token_counts():
    batch = ragged_batch()
    packed = scoring.pack(batch)
    counted = batch.completion_mask.clone()
    counted[:, 0] = 0
    assert len(packed.keep) == int((counted != 0).sum())  # one row of logits per counted token
    assert packed.input_ids.shape == (1, int(batch.attention_mask.sum()))  # no padding
    starts = packed.cu_seq_lens.tolist()
    assert starts == [0, 40, 47, 70, 71, 94, 106, 113]
    assert packed.position_ids[0, 40:47].tolist() == list(range(7))  # each sequence from position 0
    assert torch.equal(packed.input_ids[0, packed.keep + 1], packed.targets)  # the next token is the target


def test_rows_with_one_prompt_share_its_tokens_and_see_nothing_of_each_other(model):
    batch = grouped_batch()
    packed = scoring.pack(batch)
    alone = scoring.pack(batch, share=False)
    tokens = int(batch.attention_mask.sum())
    assert alone.input_ids.shape == (1, tokens)
    assert packed.input_ids.shape == (1, tokens - (3 - 1) * 6 - (3 - 1) * 9 - (3 - 1) * 6)  # each prompt once
    assert torch.equal(packed.input_ids[0, packed.keep + 1][packed.columns > 9], packed.targets[packed.columns > 9])
    assert torch.equal(packed.position_ids[0, packed.keep], packed.columns - 1)  # each at its place in its own row
    with torch.no_grad():
        shared = scoring.packed_scores(model, batch, 1.0, entropy=True)
        separate = scoring.selected_logprobs(model(**alone.model_inputs()).logits[0], alone.targets, 1.0)[0]
    torch.testing.assert_close(shared[0], alone.unpack(separate), atol=1e-5, rtol=1e-5)
    changed = grouped_batch()
    changed.input_ids[1, 9:12] = torch.randint(3, 60, (3,), generator=torch.Generator().manual_seed(5))
    changed.input_ids[3, 4] = 59 - changed.input_ids[3, 4]  # the first group's prompt, in one of its rows only
    with torch.no_grad():
        after = scoring.packed_scores(model, changed, 1.0)[0]
    untouched = [0, 2, 4, 5, 6, 7, 8, 9]  # row 1's siblings (4, 7) and row 3's (0, 6), and the others
    torch.testing.assert_close(after[untouched], shared[0][untouched], atol=1e-6, rtol=0)
    assert not torch.allclose(after[1], shared[0][1]) and not torch.allclose(after[3], shared[0][3])


def test_a_model_called_without_its_parameters_is_scored_and_prompts_are_shared_where_every_layer_attends(model):
    """The learner's LoRA reference (`lora.AdapterOff`) is a callable with no parameters of its own; a hybrid model's
    recurrent layers would read a shared segment as one sequence, and a GPU's variable-length attention takes whole
    sequences."""
    batch = grouped_batch()
    with torch.no_grad():
        wrapped = scoring.packed_scores(lambda **inputs: model(**inputs), batch, 1.0)[0]
        alone = scoring.packed_scores(model, batch, 1.0, share=False)[0]
    torch.testing.assert_close(wrapped, alone, atol=1e-5, rtol=1e-5)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert scoring.shares_prompts(cpu, model.config) and not scoring.shares_prompts(gpu, model.config)
    hybrid = model.config.__class__(layer_types=["linear_attention", "full_attention"], num_hidden_layers=2)
    assert not scoring.shares_prompts(cpu, hybrid)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_selection_equals_the_full_log_softmax(monkeypatch, dtype):
    monkeypatch.setattr(scoring, "CHUNK_ELEMENTS", 7 * 301)  # 50 rows of 301: 8 chunks, the last short
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(50, 301, generator=generator) * 3).to(dtype).requires_grad_(True)
    targets = torch.randint(0, 301, (50,), generator=generator)
    weights = torch.randn(2, 50, generator=generator)  # a loss that weighs both outputs

    def backward(logprobs, entropy):
        (grad,) = torch.autograd.grad((weights[0] * logprobs + weights[1] * entropy).sum(), logits)
        return grad

    logprobs, entropy = scoring.selected_logprobs(logits, targets, 0.8, entropy=True)
    chunked = backward(logprobs, entropy)
    full = torch.log_softmax(logits.float() / 0.8, dim=-1)
    expected_logprobs = full.gather(-1, targets[:, None]).squeeze(-1)
    expected_entropy = -(full.exp() * full).sum(-1)
    expected = backward(expected_logprobs, expected_entropy)
    torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=1e-5)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(chunked.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert scoring.selected_logprobs(logits, targets, 0.8)[1] is None


def test_token_budget_micro_batches_hold_the_budget_and_every_row_once():
    tokens = [9, 3, 7, 2, 8, 5, 1, 6]
    bins = token_budget_micro_batches(list(range(8)), tokens, budget=10)
    assert sorted(row for rows in bins for row in rows) == list(range(8))
    assert all(sum(tokens[row] for row in rows) <= 10 for rows in bins)
    assert len(bins) == 5  # 41 tokens: at least 5 bins of 10
    assert token_budget_micro_batches([0], [12], budget=10) == [[0]]  # a row over the budget goes alone


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("world_size, mini_batches, budget", [(2, 1, 13), (3, 2, 7), (1, 1, 14), (2, 2, 100)])
def test_token_budget_shards_reproduce_the_whole_batch_gradient(aggregation, world_size, mini_batches, budget):
    """As `test_shard`'s gradient test, with micro-batches by a token budget: balanced over the ranks, within the
    budget, as many on every rank, and their losses weighted so the gradient is the whole batch's."""
    batch = rollout_batch()  # twelve rows of 5, 6 and 7 tokens
    tokens = batch.attention_mask.sum(dim=1)
    torch.manual_seed(0)
    logits = torch.randn(batch.input_ids.shape, requires_grad=True)
    shards = shard_batch(batch, world_size, mini_batches, 1, aggregation, max_tokens=budget)
    for index, rows in enumerate(torch.arange(len(batch)).tensor_split(mini_batches)):
        (expected,) = torch.autograd.grad(loss_of(batch.select(rows), logits[rows], aggregation), logits)
        total, loads = torch.zeros(()), []
        assert len({len(shard.micro_batches[index]) for shard in shards}) == 1  # the same passes on every rank
        for shard in shards:
            original = shard_rows(batch, shard)
            loads.append(int(tokens[original[shard.mini_batches[index]]].sum()) if shard.mini_batches[index] else 0)
            for micro, share in shard.micro_batches_of(index):
                if share == 0:
                    continue
                assert int(tokens[original[micro]].sum()) <= budget
                length = shard.batch.input_ids.shape[1]
                part = loss_of(shard.batch.select(micro), logits[original[micro], :length], aggregation)
                total = total + part * share * shard.world_size
        assert max(loads) - min(loads) <= int(tokens.max())  # balanced to within one row
        (got,) = torch.autograd.grad(total / world_size, logits)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_a_token_budget_below_the_longest_sequence_is_refused(tmp_path):
    with pytest.raises(ConfigError) as error:
        validate_config(small_config(tmp_path, learner={"max_tokens_per_micro_batch": 10}))
    assert "learner.max_tokens_per_micro_batch (10) is below the longest sequence the learner can get (20" in str(
        error.value
    )
