"""The real loop on a local Ray cluster: Ray, vLLM (CPU backend) and DeepSpeed (gloo), no mocks."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import small_config
from safetensors.torch import load_file

from grpo_dist.config import validate_config

pytestmark = pytest.mark.slow

REQUIRED_METRICS = [
    "step", "reward/mean", "reward/std", "reward/reward_fixtures.first_char_reward", "reward/math_answer",
    "advantage/mean", "advantage/std", "loss", "kl", "clip_fraction", "grad_norm", "response_length/mean",
    "tokens_per_s", "time/generate", "time/reward", "time/train", "time/sync", "weight_version", "entropy",
    "faults/generator_restarts", "faults/reward_worker_restarts", "faults/learner_restarts",
    "reward_failures/reward_fixtures.first_char_reward", "reward_failures/math_answer", "time/step",
    "time/learner_busy", "time/learner_idle", "time/generator_idle", "queue/prompts", "generators/count",
    "generators/0/completions", "generators/1/completions", "generators/0/tokens_per_s", "staleness/mean",
    "staleness/max", "staleness/dropped",
]  # fmt: skip


def hf_logprobs(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    """Per-token logprobs of a sequence under a saved Hugging Face model, read by transformers itself."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, :-1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(token_ids[1:])[:, None]).squeeze(-1)


def vllm_imported(_actor) -> bool:
    """Whether this process imported vLLM's modules itself (those a warm process imported before forking it aside:
    `grpo_dist.cluster.warm`)."""
    import sys

    from grpo_dist.cluster.warm_launch import PRELOADED

    return any(name.split(".")[0] == "vllm" for name in set(sys.modules) - PRELOADED)


def dynamo_off(_actor) -> bool:
    """Whether vLLM's log-prob gather, which its sampler compiles with torch.compile, is a plain function in this
    process (and in the engine core forked from it): torch.compile leaves a function as it is when TORCHDYNAMO_DISABLE
    is set as its module is imported, which a warm process that imported it before (`grpo_dist.cluster.warm`) would
    defeat. And whether the processes it starts are told so too (the variable)."""
    import os

    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    compiled = hasattr(batched_count_greater_than, "_torchdynamo_orig_callable")
    return not compiled and os.environ.get("TORCHDYNAMO_DISABLE") == "1"


def test_loop_trains_every_parameter_and_generators_hold_the_new_weights(ray_cluster, tmp_path, monkeypatch):
    import ray

    from grpo_dist.cluster.cluster import ActorsDiffer, Cluster
    from grpo_dist.run import driver
    from grpo_dist.run.driver import train
    from grpo_dist.run.inputs import prepare

    # The scaled-out shape: 2 learner ranks under ZeRO-3, 2 generators, weights broadcast over gloo.
    raw = small_config(
        tmp_path,
        wandb={"enabled": True, "mode": "offline"},
        learner={"num_ranks": 2, "zero_stage": 3},
        rollout={"num_generators": 2},
    )
    cfg = validate_config(raw)
    inputs = prepare(cfg)
    initial = load_file(f"{inputs.model_path}/model.safetensors")
    cluster = Cluster.start(cfg, inputs.model_path)
    assert (len(cluster.learner.ranks), len(cluster.generators.actors), cluster.transport.name) == (2, 2, "broadcast")

    try:
        run_dir = train(cfg, cluster)
        check_run(ray_cluster, cluster, cfg, inputs, initial, run_dir)
        # The learner ranks sent every sync over gloo without importing vLLM (its import was most of their start).
        imported = [rank.__ray_call__.remote(vllm_imported) for rank in cluster.learner.ranks]
        assert ray.get(imported) == [False, False]
        # The engines run eager on CPU with torch.compile off in the generator and the engine core it forks, so
        # vLLM's log-prob gather is not compiled at their first request (3 s of each start).
        compile_off = [generator.__ray_call__.remote(dynamo_off) for generator in cluster.generators.actors]
        assert ray.get(compile_off) == [True, True]
        # A second run on the same actors starts from the initial model: every rank rebuilt in its process, the
        # generators loaded with version 0. It trains exactly as the first did (which moved the weights, above).
        held = module_stacks(ray_cluster, cluster)
        again = train(validate_config({**raw, "run": {**raw["run"], "name": "again"}}), cluster)
        assert module_stacks(ray_cluster, cluster) == held  # the first run's policy and reference were let go
        first, second = metric_rows(run_dir), metric_rows(again)
        for key in ("reward/mean", "loss", "kl", "grad_norm", "response_length/mean", "rollout/weight_version"):
            assert [row[key] for row in second] == pytest.approx([row[key] for row in first], rel=1e-5), key
        assert {row["faults/generator_restarts"] for row in second} == {0.0}
        check_lora_run(ray_cluster, cluster, raw, inputs, initial)
        # A config whose engines differ from these actors' is refused before its run keeps any file.
        other = validate_config({**raw, "run": {**raw["run"], "name": "other"}, "rollout": {**raw["rollout"],
                                 "max_model_len": 64}})  # fmt: skip
        with pytest.raises(ActorsDiffer, match=r"rollout.max_model_len differ"):
            train(other, cluster)
        assert not (run_dir.parent / "other").exists()
        # A run stopped by an error (here: Ctrl-C during a step) keeps the policy it had, and the earlier run.
        monkeypatch.setattr(driver, "train_step", interrupted_step)
        with pytest.raises(KeyboardInterrupt):
            train(cfg, cluster)
        sequence = inputs.train[0].token_ids + [7, 8, 9, 2]
        learner = torch.tensor(cluster.learner.sequence_logprobs(sequence))
        torch.testing.assert_close(hf_logprobs(str(run_dir / "interrupted"), sequence), learner, atol=1e-5, rtol=1e-5)
        assert len(list(run_dir.parent.glob(f"{run_dir.name}-*/final"))) == 1
    finally:
        cluster.shutdown()


def module_stacks(ray_cluster, cluster) -> list[int]:
    """How many modules each learner rank's process has on DeepSpeed's ZeRO-3 module stack (which holds them)."""

    def depth(rank) -> int:
        from deepspeed.runtime.zero.parameter_offload import FWD_MODULE_STACK

        return len(FWD_MODULE_STACK)

    return ray_cluster.get([rank.__ray_call__.remote(depth) for rank in cluster.learner.ranks])


def metric_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def interrupted_step(*args, **kwargs):
    raise KeyboardInterrupt


def check_run(ray_cluster, cluster, cfg, inputs, initial, run_dir) -> None:
    from grpo_dist.cluster.actors.generator import Generator

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert [set(REQUIRED_METRICS) - set(row) for row in rows] == [set()] * 3
    # Each batch was sampled by the weights of the step before it: syncs take effect on the next batch.
    assert [row["rollout/weight_version"] for row in rows] == [0, 1, 2]
    # first_char_reward raises for some completions: each such call scores its floor (reward.on_failure: floor),
    # is counted and named, and leaves nothing unscored.
    assert sum(row["reward_failures/floored"] for row in rows) > 0
    failures = [row["reward_failures/reward_fixtures.first_char_reward"] for row in rows]
    assert (
        failures
        == [row["reward_failures/floored"] for row in rows]
        == [row["reward_failures/why/raised"] for row in rows]
    )
    assert {row["reward/unscored"] for row in rows} == {0.0}
    assert {row["reward_failures/math_answer"] for row in rows} == {0.0}
    assert {row[f"faults/{name}"] for row in rows for name in ("generator_restarts", "learner_restarts")} == {0.0}

    final = ray_cluster.get(cluster.learner.state_dict())
    unchanged = [name for name, tensor in initial.items() if torch.equal(final[name], tensor)]
    assert unchanged == []

    sequence = inputs.train[0].token_ids + [7, 8, 9, 2]
    learner = torch.tensor(cluster.learner.sequence_logprobs(sequence))
    before = hf_logprobs(inputs.model_path, sequence)
    assert not torch.allclose(learner, before, atol=1e-3), "the policy should have moved away from the initial one"
    for generator in cluster.generators.actors:
        assert ray_cluster.get(generator.current_weight_version.remote()) == 3
        engine = torch.tensor(ray_cluster.get(generator.sequence_logprobs.remote(sequence)))
        torch.testing.assert_close(engine, learner, atol=1e-4, rtol=1e-4)

    # The saved policy is the trained one, readable by transformers and servable by vLLM.
    final_dir = str(run_dir / "final")
    torch.testing.assert_close(hf_logprobs(final_dir, sequence), learner, atol=1e-5, rtol=1e-5)
    served = ray_cluster.remote(Generator).options(num_cpus=1).remote(final_dir, cfg.rollout, 0)
    torch.testing.assert_close(
        torch.tensor(ray_cluster.get(served.sequence_logprobs.remote(sequence))), learner, atol=1e-4, rtol=1e-4
    )
    ray_cluster.kill(served)
    assert list((run_dir / "wandb").glob("offline-run-*")), "W&B should have logged offline into the run directory"


def check_lora_run(ray_cluster, cluster, raw, inputs, initial) -> None:
    """A LoRA run served merged (`learner.lora.serve: merged`) on the same actors (each rank rebuilds its engine with
    an adapter; the engines stay as they are): step 1 starts at the base, so its KL is exactly 0; the generators
    hold the merged policy after each sync (their logprobs are the learner's, which moved off the base's); every
    weight the adapter does not touch is the initial one; `final/` holds the merged policy, which transformers reads,
    and the adapter in PEFT's layout, which `grpo-dist export --merge` makes a model vLLM serves. (Engines serving
    the adapter itself: `test_lora.py`.)"""
    from grpo_dist.run.driver import train

    lora = {**raw["learner"], "lora": {"rank": 4, "alpha": 16, "serve": "merged"}, "lr": 5e-2}
    run_dir = train(validate_config({**raw, "run": {**raw["run"], "name": "lora"}, "learner": lora}), cluster)
    rows = metric_rows(run_dir)
    assert [row["step"] for row in rows] == [1, 2, 3] and rows[0]["kl"] == 0.0 and rows[-1]["kl"] > 0
    assert all(row["sync/probe_gap"] < 1e-4 and row["faults/sync_mismatches"] == 0 for row in rows)  # each sync checked
    merged = ray_cluster.get(cluster.learner.state_dict())
    moved = {name for name, tensor in initial.items() if not torch.equal(merged[name], tensor)}
    assert moved and all(name.endswith("_proj.weight") for name in moved), sorted(moved)

    sequence = inputs.train[0].token_ids + [7, 8, 9, 2]
    learner = torch.tensor(cluster.learner.sequence_logprobs(sequence))
    assert not torch.allclose(learner, hf_logprobs(inputs.model_path, sequence), atol=1e-3)
    for generator in cluster.generators.actors:
        engine = torch.tensor(ray_cluster.get(generator.sequence_logprobs.remote(sequence)))
        torch.testing.assert_close(engine, learner, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hf_logprobs(str(run_dir / "final"), sequence), learner, atol=1e-5, rtol=1e-5)
    adapter = {path.name for path in (run_dir / "final" / "adapter").iterdir()}
    assert adapter == {"adapter_config.json", "adapter_model.safetensors"}

    # `grpo-dist export --merge` of that adapter: a model vLLM serves, whose greedy completions are the adapter's.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_dist import cli
    from grpo_dist.cluster.actors.generator import Generator

    exported = run_dir / "exported"
    assert cli.main(["export", str(run_dir / "final" / "adapter"), str(exported), "--merge"]) == 0
    prompts = [prompt.token_ids for prompt in inputs.train[:4]]
    served = ray_cluster.remote(Generator).options(num_cpus=1).remote(str(exported), validate_config(raw).rollout, 0)
    texts = ray_cluster.get(served.judge.remote(prompts, 6))
    ray_cluster.kill(served)
    base = AutoModelForCausalLM.from_pretrained(inputs.model_path, dtype=torch.float32)
    policy = PeftModel.from_pretrained(base, str(run_dir / "final" / "adapter")).eval()
    tokenizer, expected = AutoTokenizer.from_pretrained(inputs.model_path), []
    for prompt in prompts:
        with torch.no_grad():
            ids = policy.generate(input_ids=torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :]
        expected.append(tokenizer.decode(ids, skip_special_tokens=True))
    assert texts == expected and any(texts), (texts, expected)
