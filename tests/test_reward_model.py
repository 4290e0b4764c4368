"""`reward.model`: a sequence classifier scoring each completion on actors of its own, read through its own tokenizer
and chat template (not the policy's), its logit normalized and scaled as configured and weighted with the other
rewards; refused before anything starts where it is not a classifier or lacks the label; a lost actor replaced
and its share scored again."""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch
from conftest import small_config

from grpo_dist.config import ConfigError, RewardModelConfig, validate_config
from grpo_dist.models.tiny import build_tiny_model, build_tiny_reward_model
from grpo_dist.types import ScoreRequest

RM_TEMPLATE = "{%- for message in messages -%}[{{ message['role'] }}] {{ message['content'] }}{{ '\\n' }}{%- endfor -%}"
"""The reward model's own chat template, unlike the policy's (`<|role|>content<eos>`)."""
TURNS = [{"role": "user", "content": "7 3 9 5:"}]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "model", chat_template=RM_TEMPLATE, seed=3)


def forward(path, text: str) -> float:
    """The classifier's logit for `text` alone, by transformers."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**tokenizer(text, return_tensors="pt")).logits[0, 0].item()


def test_the_classifier_reads_the_conversation_through_its_own_template_batched_as_alone(reward_model):
    from grpo_dist.cluster.actors.classifier import Classifier
    from grpo_dist.cluster.reward_model_pool import _checked

    settings = RewardModelConfig(path=str(reward_model), batch_size=3)
    classifier = Classifier(str(reward_model), settings)
    completions = ["5", "five is the answer", "55555555555555", "x"]
    items = [(TURNS, "<|user|>7 3 9 5:<eos>\n<|assistant|>", text) for text in completions]
    scored = classifier.score(items)  # a batch of 3 (padded to its longest), then one
    expected = [forward(reward_model, f"[user] 7 3 9 5:\n[assistant] {text}\n") for text in completions]
    assert [score for score, _ in scored] == pytest.approx(expected, abs=1e-5)
    assert len({round(value, 4) for value in expected}) == 4 and not any(cut for _, cut in scored)
    # without turns (a row without a chat template) the policy's prompt is the user's turn
    ((alone, _),) = classifier.score([(None, "7 3 9 5:", "5")])
    assert alone == pytest.approx(expected[0], abs=1e-5)

    squashed = Classifier(str(reward_model), RewardModelConfig(path=str(reward_model), normalize="sigmoid", scale=2))
    ((score, _),) = squashed.score(items[:1])
    assert score == pytest.approx(2 / (1 + math.exp(-expected[0])), abs=1e-5)
    # a logit that overflowed stays non-finite through the sigmoid, and the pool leaves its completion unscored
    assert math.isnan(squashed._normalized(math.nan)) and squashed._normalized(-math.inf) == -math.inf
    assert [why for _, why in map(_checked, (math.nan, math.inf, 0.5, None))] == [
        "the reward model gave a non-finite score (nan)", "the reward model gave a non-finite score (inf)", None,
        "the reward model's actor was lost"]  # fmt: skip

    short = Classifier(str(reward_model), RewardModelConfig(path=str(reward_model), max_length=16))
    ids, cut = short.tokens(TURNS, "", "9" * 40)
    whole = short.tokenizer(f"[user] 7 3 9 5:\n[assistant] {'9' * 40}\n")["input_ids"]
    assert cut and len(ids) == 16 and ids == whole[:8] + whole[-8:]  # its start and the completion's end


def test_a_reward_model_must_be_listed_a_classifier_and_have_its_label(tmp_path, reward_model):
    from grpo_dist.run.inputs import reward_model_directory

    functions = [{"name": "reward_model", "weight": 1.0}]
    with pytest.raises(ValueError, match="reward.model is set: list its score once in reward.functions"):
        validate_config(small_config(tmp_path, reward={"model": {"path": str(reward_model)}}))
    with pytest.raises(ValueError, match="reward.functions names `reward_model`, and reward.model"):
        validate_config(small_config(tmp_path, reward={"functions": functions}))
    judged = small_config(tmp_path, reward={"model": {"path": str(reward_model)}, "functions": functions})
    with pytest.raises(ValueError, match="eval.reward .* is `reward_model`: an evaluation counts the answers"):
        validate_config({**judged, "eval": {"reward": "reward_model"}})
    with pytest.raises(ValueError, match="less than or equal to 1"):  # the model runs whole on one GPU
        validate_config(small_config(tmp_path, reward={"model": {"path": "m", "num_gpus": 2}, "functions": functions}))

    def checked(**model) -> None:
        reward_model_directory(validate_config(small_config(tmp_path, reward={"model": model, "functions": functions})))

    checked(path=str(reward_model))
    causal = build_tiny_model(tmp_path / "causal")
    with pytest.raises(ConfigError, match="is a Qwen2ForCausalLM, not a sequence classifier"):
        checked(path=str(causal))
    with pytest.raises(ConfigError, match=r"reward.model.label: 1, and .* has 1 label\(s\) \(0 to 0\)"):
        checked(path=str(reward_model), label=1)
    with pytest.raises(ConfigError, match="reward.model.path: .*nowhere is neither a model directory nor a hub id"):
        checked(path=str(tmp_path / "nowhere"))


def test_a_reward_model_that_cannot_read_the_first_prompt_is_refused_before_the_run(tmp_path, reward_model):
    """Its template refusing a system turn (`data.system_prompt`), or a `max_length` past its positions."""
    from grpo_dist.data import PromptRecord
    from grpo_dist.run.inputs import check_reward_model_reads

    no_system = "{%- if messages[0]['role'] == 'system' -%}{{ raise_exception('no system role') }}{%- endif -%}"
    strict = build_tiny_reward_model(tmp_path / "strict", chat_template=no_system + RM_TEMPLATE)
    functions = [{"name": "reward_model", "weight": 1.0}]

    def config(path, **model):
        return validate_config(small_config(tmp_path, reward={"model": {"path": str(path), **model},
                                                              "functions": functions}))  # fmt: skip

    plain = PromptRecord("7 3 9 5:", [1], messages=TURNS)
    system = PromptRecord("7 3 9 5:", [1], messages=[{"role": "system", "content": "be brief"}, *TURNS])
    check_reward_model_reads(config(strict), str(strict), plain)
    check_reward_model_reads(config(reward_model), str(reward_model), system)
    with pytest.raises(
        ConfigError, match=r"reward.model: its tokenizer cannot read .*\(TemplateError: no system role\)"
    ):
        check_reward_model_reads(config(strict), str(strict), system)
    with pytest.raises(
        ConfigError, match="reward.model.max_length \\(1024\\) is above the reward model's 256 positions"
    ):
        check_reward_model_reads(config(reward_model, max_length=1024), str(reward_model), plain)


@pytest.mark.slow
def test_a_runs_completions_are_scored_by_the_reward_model_on_its_own_actors_weighted_with_the_others(
    ray_cluster, tmp_path, reward_model
):
    """The reward pool asks the reward model's actor first; its score is the function `reward_model`, weighted
    into the total with `math_answer`. The actor killed (its process, SIGKILL) is replaced, counted, and the next
    batch scored the same."""
    from grpo_dist.cluster.placement import place
    from grpo_dist.cluster.reward_pool import RewardPool
    from grpo_dist.faults import FaultLog

    model = {"path": str(reward_model), "normalize": "sigmoid", "batch_size": 2}  # 3 completions: in 2 rounds
    raw = small_config(tmp_path, reward={"model": model, "functions": [
        {"name": "reward_model", "weight": 0.5}, {"name": "math_answer", "weight": 1.0}]})  # fmt: skip
    config = validate_config(raw)
    prompt = "<|user|>7 3 9 5:<eos>\n<|assistant|>"
    requests = [ScoreRequest(prompt, text, {"answer": "5"}, turns=TURNS) for text in ("5", "4", "the answer: 5")]
    placement, faults = place(config), FaultLog()
    rewards = RewardPool(config, placement, faults)
    try:
        rewards.wait_ready()
        first = rewards.score(requests)
        metrics = rewards.step_metrics()
        (actor,) = rewards.model.pool.actors
        os.kill(ray_cluster.get(actor.__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)
        again = rewards.score(requests)
        restarts = faults.counts["reward_model_restarts"]
    finally:
        rewards.shutdown()
        placement.remove()
    for request, score, other in zip(requests, first, again, strict=True):
        logit = forward(reward_model, f"[user] 7 3 9 5:\n[assistant] {request.completion}\n")
        expected = 1 / (1 + math.exp(-logit))
        correct = 1.0 if request.completion.endswith("5") else 0.0
        assert score.per_function == [pytest.approx(expected, abs=1e-5), correct] and not score.failures
        assert score.total == pytest.approx(0.5 * expected + correct, abs=1e-5)
        assert other.per_function == pytest.approx(score.per_function, abs=1e-6)
    assert metrics["reward_model/seconds"] > 0 and metrics["reward_model/truncated"] == 0
    assert restarts == 1


@pytest.mark.slow
def test_a_run_trains_on_the_reward_models_scores(ray_cluster, capfd, tmp_path, reward_model):
    """`grpo-dist train` with the reward model as its only reward: its actor starts beside the others, and every
    step's completions are scored by it (the sigmoid of a logit: strictly between 0 and 1), none unscored."""
    import json

    from conftest import train_here

    raw = small_config(tmp_path, run={"steps": 2}, reward={
        "model": {"path": str(reward_model), "normalize": "sigmoid"},
        "functions": [{"name": "reward_model", "weight": 1.0}]})  # fmt: skip
    config = tmp_path / "rm.yaml"
    config.write_text(json.dumps(raw))
    code, output = train_here(capfd, config)
    assert code == 0, output[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "outputs" / "test" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert 0 < row["reward/min"] < row["reward/max"] < 1, row
        assert row["reward_model/seconds"] > 0 and row["reward_failures/reward_model"] == 0
        assert row["faults/unscored"] == 0 and row["faults/reward_model_restarts"] == 0


def test_the_plan_counts_a_reward_model_on_its_gpus_and_refuses_one_that_does_not_fit(tmp_path):
    """A 7B classifier (Qwen2.5-7B's shape) on one 80 GB GPU: 15.2 GB of bf16 weights and, at 16 x 2048 tokens a
    forward, 6.8 GB of activations; at 256 x 2048 it needs 125 GB and is refused naming what to lower."""
    from grpo_dist.config.plan import Shape, plan

    shape = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
             "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
             "architectures": ["Qwen2ForSequenceClassification"], "num_labels": 1}  # fmt: skip
    (tmp_path / "config.json").write_text(__import__("json").dumps(shape))
    scorer = Shape.of(tmp_path)

    def planned(batch_size: int):
        model = {"path": str(tmp_path), "num_gpus": 1, "batch_size": batch_size, "max_length": 2048}
        raw = small_config(tmp_path, reward={"model": model, "functions": [{"name": "reward_model"}]})
        raw["cluster"] = {"gpu_memory_gb": 80}
        return plan(validate_config(raw), scorer, scorer=scorer)

    fits = planned(16)
    assert fits.scorer == pytest.approx({"weights": 15.23, "activations": 6.84}, abs=0.01) and not fits.problems()
    assert "  reward model: 22.1 of 80 GB (weights 15.2, activations 6.8)" in fits.lines()
    (problem,) = planned(256).problems()
    assert problem.startswith("a reward-model actor needs 124.8 GB") and "lower reward.model.batch_size" in problem
