"""The check after a weight sync, without Ray: its probe sequence, its default bound by the run's dtypes, and the
injected fault that makes an engine drop what it was sent (`faults.inject.drop_weights`; `test_lora.py` runs the
check with the real stack)."""

from __future__ import annotations

import pytest
from conftest import small_config

from grpo_dist.config import InjectConfig, validate_config
from grpo_dist.faults import Bound
from grpo_dist.faults.inject import Injector
from grpo_dist.transports.weight_check import Probe, WeightCheck, max_gap, probe_tokens


def test_the_probe_is_the_first_prompts_joined_and_cut_to_the_engines_length(tmp_path):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    assert probe_tokens(prompts, 64) == [5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert probe_tokens(prompts, 4) == [5, 6, 7, 8]
    with pytest.raises(ValueError, match="at least two tokens"):
        probe_tokens([[5]], 64)
    cfg = validate_config(small_config(tmp_path, rollout={"max_model_len": 8}))
    assert WeightCheck.of(cfg, [list(range(100))]).tokens == list(range(7))  # room for the one token it samples


@pytest.mark.parametrize(
    ("rollout", "learner", "sync", "expected"),
    [
        ({}, {}, {}, 1e-3),  # a CPU run: float32 on both sides
        ({"dtype": "bfloat16"}, {}, {}, 0.1),
        ({}, {"dtype": "bfloat16"}, {}, 0.1),
        ({"num_gpus": 1}, {}, {}, 0.1),  # auto on a GPU: the model's dtype, bf16 for most
        ({"num_gpus": 1, "dtype": "float32"}, {"num_gpus": 1, "dtype": "float32"}, {}, 1e-3),
        ({"dtype": "bfloat16"}, {}, {"probe_max_gap": 0.02}, 0.02),
    ],
)
def test_the_default_bound_follows_the_dtypes_and_a_set_one_wins(tmp_path, rollout, learner, sync, expected):
    cfg = validate_config(small_config(tmp_path, rollout=rollout, learner=learner, sync=sync))
    assert max_gap(cfg) == expected


def test_injected_dropped_weights_drop_the_listed_versions_once_or_every_time():
    hook = Injector(InjectConfig(drop_weights=[{"version": 2, "once": True}, {"version": 4}]))
    assert [hook.drops(version) for version in (1, 2, 2, 3, 4, 4)] == [0, 1, 0, 0, 1, 1]
    assert not Injector(InjectConfig()).drops(4)


@pytest.mark.parametrize(
    ("gaps", "moved", "mismatch"),
    [
        pytest.param([2e-7], None, False, id="a-healthy-float32-sync"),
        pytest.param([2e-3], None, True, id="the-first-check-has-the-bound-alone"),
        # the learner moved 12 per token in one update (learning rate 50); 0.0086 < 0.1 x 12: float32 on large logits
        pytest.param([2e-7, 0.0086], 12.0, False, id="a-diverging-policy-is-not-the-engines-fault"),
        # an engine that kept the weights it had is as far as the update moved: 0.05 > 0.1 x 0.05
        pytest.param([0.05, 1e-7], 0.05, True, id="an-engine-that-missed-the-update"),
        # the initial weights served at version 2: twice the last update's move away
        pytest.param([0.08], 0.04, True, id="an-engine-back-at-the-initial-weights"),
    ],
)
def test_a_gap_is_a_mismatch_over_the_bound_and_a_tenth_of_the_learners_own_move(gaps, moved, mismatch):
    probe = Probe(gaps, expected=[-1.0], moved=moved)
    assert probe.mismatch(1e-3) is mismatch
    assert probe.gaps[probe.worst] == max(gaps)


def test_each_check_measures_the_move_from_the_last_version_the_engines_were_found_serving():
    class Learner:
        def __init__(self) -> None:
            self.logprobs = [-1.0, -2.0]

        def sequence_logprobs(self, tokens: list[int]) -> list[float]:
            return self.logprobs

    learner, check = Learner(), WeightCheck([1, 2, 3], 1e-3, Bound(1.0))
    first = check.probe(learner, [])
    assert first.moved is None
    check.passed(first)
    learner.logprobs = [-1.5, -2.5]  # an update moved each token's log-prob by 0.5
    assert check.probe(learner, []).moved == 0.5
    assert check.probe(learner, []).moved == 0.5  # not passed: still measured from the version served


def test_with_the_engines_probed_before_the_first_sync_its_move_is_measured_too():
    """`Cluster.check_syncs` probes the engines at the version they start with: the first update's move is then a
    bound as every later one's is. At learning rate 50 the first update moves the probe's log-probabilities by
    about 10 per token and leaves the engines' float32 kernels 0.019 from the learner's (as measured on a CPU): no
    mismatch. An engine that kept the initial weights is as far as the whole move: a mismatch."""

    class Learner:
        logprobs = [-2.7, -2.7]  # the initial model: near uniform over 16 tokens

        def sequence_logprobs(self, tokens: list[int]) -> list[float]:
            return self.logprobs

    learner, check = Learner(), WeightCheck([1, 2, 3], 1e-3, Bound(1.0))
    check.passed(check.probe(learner, []))  # before the first sync: the engines serve version 0
    learner.logprobs = [-12.7, -0.0]  # the wrecking update: moved by 10 and 2.7, 6.35 per token on average
    first_sync = check.probe(learner, [])
    assert first_sync.moved == pytest.approx(6.35)
    assert not Probe([0.019], first_sync.expected, first_sync.moved).mismatch(1e-3)  # 0.019 < 0.1 x 6.35
    assert Probe([6.35], first_sync.expected, first_sync.moved).mismatch(1e-3)  # the engine missed the update
