"""Collecting a step's groups (`grpo_dist.run.rollouts.collect`): what it does with each event of a generation. The
generator pool and the reward pool are stood in for by scripted objects here (the real ones run in the loop tests
of test_loop.py, test_overlap.py and test_faults.py); what is tested is the decisions: every group scored as it
comes and the batch put back in prompt order, a replaced generator reconnected before it gets work, the in-flight
sync made once the learner's step has ended, and a failure that cancels the requests under way."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import small_config

from grpo_dist.algo.throughput import StepTimer
from grpo_dist.cluster.generator_pool import Advanced
from grpo_dist.config import validate_config
from grpo_dist.data import PromptRecord, PromptSampler
from grpo_dist.faults import RunFailed
from grpo_dist.run.rollouts import collect_rollout
from grpo_dist.types import Completion, Score


class ScriptedGeneration:
    """Finishes one prompt's group per `advance`, in `order` (prompt indices; then the rest in order), and says a
    generator was replaced on the calls numbered in `replaced_on`. Every call is written to `events`."""

    def __init__(self, prompts, group_size, events, order=(), replaced_on=()):
        self.prompts, self.group_size, self.events = list(prompts), group_size, events
        self.order, self.replaced_on = list(order), set(replaced_on)
        self.done: dict[int, list[Completion]] = {}
        self.calls = 0

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.prompts)

    def add(self, prompts, seeds) -> None:
        self.prompts += prompts

    def advance(self, poll: bool = False) -> Advanced:
        self.calls += 1
        self.events.append("advance")
        waiting = [index for index in self.order if index not in self.done]
        waiting += [index for index in range(len(self.prompts)) if index not in self.done and index not in waiting]
        if not waiting:
            return Advanced()
        index = waiting[0]
        self.done[index] = [Completion(index, [1], [2], str(n), [-0.5], "stop", 0) for n in range(self.group_size)]
        return Advanced([self.done[index]], replaced=self.calls in self.replaced_on)

    def completions(self) -> list[Completion]:
        return [completion for index in sorted(self.done) for completion in self.done[index]]

    def cancel(self) -> None:
        self.events.append("cancel")


def cluster_of(generation, events, score=None, learner_done_after: int | None = None):
    """A stand-in cluster around `generation`: its reward pool scores a completion by its prompt's number and
    sample (prompt p, sample n -> p + n / 10); its learner ends its training step on poll number
    `learner_done_after`."""

    def default_score(requests):
        return [Score(float(r.prompt) + float(r.completion) / 10, [float(r.prompt) + float(r.completion) / 10])
                for r in requests]  # fmt: skip

    polls = []

    def poll():
        polls.append(1)
        return learner_done_after is not None and len(polls) >= learner_done_after

    def start(prompts, group_size, evaluation=None, seeds=None):
        generation.prompts = list(prompts)
        return generation

    def sync_weights():  # as the cluster's: the generators then hold the learner's version
        events.append("sync")
        generators.weight_version = learner.version

    generators = SimpleNamespace(start=start, weight_version=0)
    learner = SimpleNamespace(poll=poll, version=1)
    return SimpleNamespace(
        generators=generators,
        rewards=SimpleNamespace(score=score or default_score),
        teacher=None,  # no distillation
        learner=learner,
        reconnect=lambda: events.append("reconnect"),
        sync_weights=sync_weights,
    )


def sampler_of(count: int = 40, per_step: int = 4) -> PromptSampler:
    return PromptSampler([PromptRecord(str(i), [1], {}) for i in range(count)], per_step, seed=0)


def test_groups_finishing_out_of_order_come_back_in_prompt_order_with_their_scores(tmp_path):
    cfg = validate_config(small_config(tmp_path))  # 4 prompts a step, groups of 4
    events: list[str] = []
    generation = ScriptedGeneration([], 4, events, order=[3, 1, 0, 2])
    cluster = cluster_of(generation, events)
    rollout, metrics = collect_rollout(cfg, cluster, sampler_of(), StepTimer(), step=1)
    assert [c.prompt_index for c in rollout.completions] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    # Each score is its own completion's: prompt p's sample n scored p + n / 10.
    expected = [float(rollout.prompts[c.prompt_index].text) + int(c.text) / 10 for c in rollout.completions]
    assert [score.total for score in rollout.scores] == expected
    assert events.count("advance") == 4 and events[-1] == "cancel"
    assert metrics == {"sync/in_flight": 0.0}


def test_a_replaced_generator_is_reconnected_before_it_gets_more_work(tmp_path):
    cfg = validate_config(small_config(tmp_path))
    events: list[str] = []
    generation = ScriptedGeneration([], 4, events, replaced_on={2})
    cluster = cluster_of(generation, events)
    collect_rollout(cfg, cluster, sampler_of(), StepTimer(), step=1)
    assert events == ["advance", "advance", "reconnect", "advance", "advance", "cancel"]


@pytest.mark.parametrize(("in_flight", "syncs"), [(False, 0), (True, 1)], ids=["between-batches", "in-flight"])
def test_an_in_flight_sync_comes_once_the_learners_step_has_ended(tmp_path, in_flight, syncs):
    """The learner's step ends at its third poll; the generators hold version 0 and the learner 1, so at k = 1 a
    sync is due then (it is not while the step is under way), and only in-flight mode makes it mid-batch."""
    cfg = validate_config(small_config(tmp_path, rollout={"max_staleness": 1}))
    events: list[str] = []
    generation = ScriptedGeneration([], 4, events)
    cluster = cluster_of(generation, events, learner_done_after=3)
    _, metrics = collect_rollout(cfg, cluster, sampler_of(), StepTimer(), step=1, in_flight=in_flight)
    assert events.count("sync") == syncs
    if in_flight:  # polled after each advance: the step ended at the third
        assert events.index("sync") == 3 and events[:3] == ["advance"] * 3
    assert metrics["sync/in_flight"] == float(syncs)


def test_a_group_that_cannot_be_scored_ends_dynamic_sampling_with_the_error(tmp_path):
    """The reward pool past its restarts: the step stops with its error instead of waiting for that group, and the
    requests under way are cancelled."""

    def score(requests):
        raise RunFailed("reward worker lost; already restarted 3 times (faults.max_reward_worker_restarts)")

    cfg = validate_config(small_config(tmp_path, algorithm={"dynamic_sampling": True}))
    events: list[str] = []
    generation = ScriptedGeneration([], 4, events)
    cluster = cluster_of(generation, events, score=score)
    with pytest.raises(RunFailed, match="already restarted"):
        collect_rollout(cfg, cluster, sampler_of(), StepTimer(), step=1)
    assert events[-1] == "cancel"
    assert events.count("advance") < 200  # it stopped on the error, not after polling on and on
