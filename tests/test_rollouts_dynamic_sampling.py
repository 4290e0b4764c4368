"""Dynamic sampling (`grpo_dist.run.rollouts.dynamic_sampling`): the prompts a step streams and the groups it trains
on, whatever order the engines finish them in. No actors."""

from __future__ import annotations

import pytest
from conftest import small_config

from grpo_dist.config import validate_config
from grpo_dist.data import PromptRecord, PromptSampler
from grpo_dist.run.rollouts import Rollout
from grpo_dist.run.rollouts.dynamic_sampling import Refill, prompt_seeds
from grpo_dist.types import Completion, Score


def stream_refill(tmp_path, informative: set[int], order_seed: int, rounds: int = 3) -> tuple[Refill, Rollout, int]:
    """Run dynamic sampling's `Refill` for one step of 4 prompts over 40 numbered records, scoring the groups sent
    in a random order (`order_seed`) as the engines might finish them: record i's group is informative when i is
    in `informative`. Returns the refill, the step's batch and the sampler's position after the step."""
    import random

    raw = small_config(tmp_path, algorithm={"dynamic_sampling": True, "max_sampling_rounds": rounds})
    raw["reward"]["functions"] = [{"name": "math_answer", "weight": 1.0}]
    cfg = validate_config(raw)
    sampler = PromptSampler([PromptRecord(str(i), [1], {}) for i in range(40)], 4, seed=0)
    refill, order = Refill(cfg, sampler, "0:1"), random.Random(order_seed)
    sent, _ = refill.first()
    sent, groups = list(sent), {}
    while (streamed := refill.more()) is not None:
        sent += [prompt for prompt, _ in streamed]
        index = order.choice([index for index in range(len(sent)) if index not in groups])
        rewards = [1.0, 0.0, 0.0, 0.0] if int(sent[index].text) in informative else [0.0] * 4
        groups[index] = [(Completion(index, [1], [2], "2", [-0.5], "stop", 0), Score(r, [r])) for r in rewards]
        refill.scored(sent, [c for c, _ in groups[index]], [score for _, score in groups[index]])
    pairs = [pair for index in sorted(groups) for pair in groups[index]]
    rollout = Rollout(sent, [c for c, _ in pairs], [score for _, score in pairs])
    batch = refill.batch(rollout)
    return refill, batch, sampler.state_dict()["position"]


def test_dynamic_sampling_streams_prompts_and_trains_on_the_same_groups_whatever_order_they_finish_in(tmp_path):
    draw_order = [int(record.text) for record in PromptSampler([PromptRecord(str(i), [1], {}) for i in range(40)],
                                                               40, seed=0).draw(40)]  # fmt: skip
    informative = set(draw_order[2:12:2])  # the 3rd, 5th, 7th, 9th and 11th prompts drawn
    outcomes = set()
    for order_seed in range(20):
        refill, batch, position = stream_refill(tmp_path, informative, order_seed)
        kept = tuple(int(p.text) for p in batch.prompts)
        outcomes.add((kept, position))
        assert len(batch.completions) == 4 * 4 and refill.sent <= 12  # never past the cap of 3 x 4 prompts
        metrics = refill.metrics()
        assert metrics["dynamic_sampling/rounds"] == 9 / 4  # the 9th prompt drawn completes the 4 informative
        assert metrics["dynamic_sampling/dropped_fraction"] == pytest.approx(5 / 9)
        assert metrics["dynamic_sampling/discarded"] == refill.sent - 9
    assert outcomes == {(tuple(draw_order[2:10:2]), 9)}  # the first 4 informative; the next step draws from the 10th


def test_dynamic_sampling_past_its_cap_trains_on_what_it_has(tmp_path):
    draw_order = [int(record.text) for record in PromptSampler([PromptRecord(str(i), [1], {}) for i in range(40)],
                                                               40, seed=0).draw(40)]  # fmt: skip
    refill, batch, position = stream_refill(tmp_path, {draw_order[5]}, order_seed=0, rounds=2)
    assert [int(p.text) for p in batch.prompts] == [draw_order[5]] and position == 8
    assert refill.metrics()["dynamic_sampling/dropped_fraction"] == 7 / 8
    refill, batch, position = stream_refill(tmp_path, set(), order_seed=0, rounds=2)
    assert [int(p.text) for p in batch.prompts] == draw_order[4:8]  # nothing informative: the last 4, advantage 0
    assert refill.metrics()["dynamic_sampling/dropped_fraction"] == 1.0


def test_a_steps_first_batch_is_seeded_alike_with_and_without_dynamic_sampling():
    first = prompt_seeds("0:1", batch=4, count=4)
    streamed = prompt_seeds("0:1", batch=4, count=10)
    assert streamed[:4] == first  # the first batch of 4: the same seeds either way
    assert streamed[4:8] == prompt_seeds("0:1", batch=4, count=8)[4:]  # the second batch: its own stream
    assert streamed[4:8] != first  # ... which is not the first batch's
    assert prompt_seeds("0:2", batch=4, count=4) != first  # another step, other seeds
    assert len(streamed) == 10 and all(0 <= seed < 2**31 for seed in streamed)
