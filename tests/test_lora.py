"""LoRA's pieces on a tiny model, without Ray or DeepSpeed: the merge the engines get, the reference with the adapter
off, and the pre-flight check of `learner.lora.target_modules`; and, with the real stack, the check after each weight
sync catching an engine that dropped the adapter."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import injected, small_config, train_config_here, written_checkpoint

from grpo_dist.config import ConfigError, validate_config
from grpo_dist.config.sections import LoraConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from grpo_dist.models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("model")))


def wrapped(model_dir: str, seed: int = 1, **lora):
    """The tiny model with an adapter whose B is random (a freshly made adapter is zero, a no-op), drawn at `seed`."""
    from transformers import AutoModelForCausalLM

    from grpo_dist.models import lora as lora_module

    policy = lora_module.wrap(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), LoraConfig(**lora))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if ".lora_B." in name:
                param.normal_(std=0.1)
    return policy


def test_the_merged_state_is_the_one_peft_merges_under_the_base_models_names_and_leaves_the_base_as_it_was(
    model_dir, tmp_path
):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from grpo_dist.models.lora import adapter_state_dict, merged_name, merged_state_dict, save_adapter

    policy = wrapped(model_dir, rank=4, alpha=8, target_modules=["q_proj", "down_proj"])
    merged = merged_state_dict(policy)
    initial = load_file(f"{model_dir}/model.safetensors")
    assert merged.keys() >= initial.keys() and not any("lora" in name for name in merged)
    moved = sorted(name for name in initial if not torch.equal(merged[name], initial[name]))
    assert moved == sorted(name for name in initial if name.endswith(("q_proj.weight", "down_proj.weight")))
    base = {merged_name(name): param for name, param in policy.named_parameters() if merged_name(name)}
    assert all(torch.equal(base[name], initial[name]) for name in initial)  # the merge wrote no base weight

    # W + B A * alpha / rank, as PEFT's own merge computes it, for q_proj of layer 0:
    layer = policy.base_model.model.model.layers[0].self_attn.q_proj
    delta = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * (8 / 4)  # [out, in]
    name = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(merged[name], initial[name] + delta, rtol=1e-6, atol=1e-7)

    save_adapter(policy, adapter_state_dict(policy), out := tmp_path / "adapter")
    fresh = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    by_peft = PeftModel.from_pretrained(fresh, str(out)).merge_and_unload().state_dict()
    for name in initial:
        torch.testing.assert_close(by_peft[name], merged[name], rtol=1e-6, atol=1e-7)


def test_the_reference_is_the_base_model_and_the_policy_is_not(model_dir):
    from transformers import AutoModelForCausalLM

    from grpo_dist.models.lora import AdapterOff

    policy = wrapped(model_dir, rank=4, alpha=8)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    input_ids = torch.tensor([[3, 7, 11, 5, 9]])
    with torch.no_grad():
        expected = base(input_ids=input_ids).logits
        off = AdapterOff(policy)(input_ids=input_ids).logits
        on = policy(input_ids=input_ids).logits
    torch.testing.assert_close(off, expected, rtol=0, atol=0)
    assert not torch.allclose(on, expected, atol=1e-3)


def test_target_modules_that_name_no_linear_layer_are_refused_before_the_run_naming_those_that_would(
    model_dir, tmp_path
):
    from grpo_dist.run.inputs import check_lora_targets

    def config(targets: list[str]):
        return validate_config(small_config(tmp_path, learner={"lora": {"target_modules": targets}}))

    check_lora_targets(config(["q_proj", "up_proj"]), model_dir)
    with pytest.raises(ConfigError) as refused:
        check_lora_targets(config(["q_proj", "qkv_proj"]), model_dir)
    message = str(refused.value)
    assert "learner.lora.target_modules: ['qkv_proj']" in message and "'v_proj'" in message, message


def test_an_adapter_on_the_output_layer_tied_to_the_embedding_is_refused(model_dir, tmp_path):
    """The tiny model ties `lm_head` to the input embedding: engines and transformers read that weight once, as the
    embedding, so a merged adapter on it would never be served."""
    from grpo_dist.run.inputs import check_lora_targets

    cfg = validate_config(small_config(tmp_path, learner={"lora": {"target_modules": ["lm_head"], "serve": "merged"}}))
    with pytest.raises(ConfigError, match=r"\['lm_head'\] is tied to the input embedding"):
        check_lora_targets(cfg, model_dir)


def test_in_bfloat16_the_merge_is_rounded_once_from_float32(model_dir):
    """A bf16 weight plus an adapter's small product: computed in float32 and rounded once, so an update is not
    lost to a bf16 product rounded before the sum. (Updates under half a bf16 step of a weight still round away:
    the engines get the merged weights in their dtype.)"""
    from grpo_dist.models.lora import merged_weight

    policy = wrapped(model_dir, rank=4, alpha=8).to(torch.bfloat16)
    layer = policy.base_model.model.model.layers[0].mlp.up_proj
    a, b = layer.lora_A["default"].weight.float(), layer.lora_B["default"].weight.float()
    expected = (layer.base_layer.weight.float() + (b @ a) * 2.0).to(torch.bfloat16)
    merged = merged_weight(layer)
    assert merged.dtype == torch.bfloat16 and torch.equal(merged, expected)
    assert not torch.equal(merged, layer.base_layer.weight)


def test_a_resume_with_other_lora_settings_is_refused_and_one_with_another_dropout_is_not(tmp_path):
    """The adapter's rank, scale and modules decide what the checkpoint's adapter means; its dropout does not."""
    from grpo_dist.run import checkpoints
    from grpo_dist.storage.run_dir import open_run

    raw = small_config(tmp_path, learner={"lora": {"rank": 4}})
    checkpoint = written_checkpoint(tmp_path / "step-000003", raw)

    def resumed(learner: dict) -> list[str]:
        cfg = validate_config({**raw, "learner": {**raw["learner"], **learner}})
        return checkpoints.check_config(cfg, checkpoints.find(open_run(cfg)[1], str(checkpoint)))

    assert resumed({"lora": {"rank": 4, "dropout": 0.1}}) == ["learner.lora.dropout: 0.0 -> 0.1"]
    for learner, change in [({"lora": {"rank": 8}}, "learner.lora.rank: 4 -> 8"),
                            ({"lora": {"rank": 4, "alpha": 8}}, "learner.lora.alpha: 32.0 -> 8.0"),
                            ({"lora": None}, "learner.lora.rank: 4 -> None")]:  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(change)):
            resumed(learner)


def test_what_engines_cannot_serve_as_an_adapter_is_refused_naming_the_way_out(tmp_path):
    """vLLM builds LoRA slots up to rank 512, and an adapter goes whole (no delta sync): both refused when the
    engines serve the adapter, both fine when they serve it merged."""
    from grpo_dist.transports.base import adapter_slots

    with pytest.raises(ConfigError, match="rank 512 at most; lower it or set learner.lora.serve=merged"):
        validate_config(small_config(tmp_path, learner={"lora": {"rank": 1024}}))
    with pytest.raises(ConfigError, match="names lm_head: .* leave it out or set learner.lora.serve=merged"):
        validate_config(small_config(tmp_path, learner={"lora": {"target_modules": ["q_proj", "lm_head"]}}))
    with pytest.raises(ConfigError, match="sync.delta .* set sync.delta to false, or learner.lora.serve=merged"):
        validate_config(small_config(tmp_path, learner={"lora": {}}, sync={"delta": True}))
    merged = small_config(tmp_path, learner={"lora": {"rank": 1024, "serve": "merged"}}, sync={"delta": True})
    assert adapter_slots(validate_config(merged)) is None
    assert adapter_slots(validate_config(small_config(tmp_path, learner={"lora": {"rank": 20}}))) == (32, 2)


def test_export_merges_the_saved_adapter_into_a_model_transformers_loads_with_the_adapters_outputs(
    model_dir, tmp_path, capsys
):
    """`grpo-dist export ADAPTER OUT --merge` on an adapter saved as a run saves it: the merged model's logits are
    the adapted policy's (which differ from the base's) and its greedy completions the same; bad input is refused
    with one line naming what to pass, and OUT is never left half-written."""
    from transformers import AutoModelForCausalLM

    from grpo_dist import cli
    from grpo_dist.models import lora as lora_module

    policy = wrapped(model_dir, rank=4, alpha=8).eval()
    adapter = tmp_path / "final" / "adapter"
    lora_module.save_adapter(policy, lora_module.adapter_state_dict(policy), adapter)
    out = tmp_path / "merged"
    assert cli.main(["export", str(adapter), str(out), "--merge"]) == 0
    assert "adapted weights merged" in capsys.readouterr().out
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 9, 12, 7, 30, 3, 8, 11]])
    with torch.no_grad():
        adapted, got = policy(input_ids=ids).logits, merged(input_ids=ids).logits
        assert not torch.allclose(adapted, base(input_ids=ids).logits, atol=1e-3)  # the adapter changes the outputs
        torch.testing.assert_close(got, adapted, atol=1e-5, rtol=1e-5)
        greedy = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(merged.generate(ids, **greedy), policy.generate(input_ids=ids, **greedy))
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= {path.name for path in out.iterdir()}

    def refused(*args: str) -> str:
        assert cli.main(["export", *args, "--merge"]) == 2
        return capsys.readouterr().err

    assert "exists and is not an empty directory" in refused(str(adapter), str(out))
    assert "not a LoRA adapter (no adapter_config.json)" in refused(str(tmp_path), str(tmp_path / "other"))
    assert "name the initial model of the run with --base" in refused(
        str(adapter), str(tmp_path / "other"), "--base", str(tmp_path / "nowhere")
    )
    assert not (tmp_path / "other").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.slow
def test_an_engine_that_drops_the_adapter_is_caught_within_the_step_resynced_and_if_it_persists_stops_the_run(
    ray_cluster, capfd, tmp_path
):
    """A LoRA run (`grpo-dist train` on the tests' cluster) whose engine serves the adapter itself: each sync sends the
    adapter alone (a small fraction of the model's bytes), and the check after it finds the engine's log-probabilities
    the learner's. Its generator, right after loading adapter version 2 the first time and version 4 every time,
    serves the base instead (the adapter dropped) while labelling what it serves with the new version
    (`faults.inject.drop_weights`). The check catches both in the step that synced: version 2 is sent again and taken,
    and the run goes on with one mismatch counted; version 4 is dropped again after it is sent again, and the run stops,
    naming the generator and the bound."""
    raw = small_config(tmp_path, run={"steps": 6}, learner={"lr": 5e-2, "lora": {"rank": 4, "alpha": 16}})
    raw = injected(raw, drop_weights=[{"version": 2, "once": True}, {"version": 4}])
    run_dir = tmp_path / "outputs" / "test"
    code, output = train_config_here(capfd, tmp_path, raw)
    assert code == 1, output[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3], output[-3000:]
    assert [row["faults/sync_mismatches"] for row in rows] == [0, 1, 1]
    assert max(row["sync/probe_gap"] for row in rows) < 1e-4  # each sync, once taken, serves the learner's policy
    model_bytes = (tmp_path / "model" / "model.safetensors").stat().st_size
    sent = [row["sync/sent_mb"] * 2**20 for row in rows]
    assert sent[0] < model_bytes / 10 and sent[1] == 2 * sent[0] == 2 * sent[2]  # the adapter alone; twice at step 2

    caught = [line for line in output.splitlines() if line.startswith("fault: ")]
    print("probe gaps after each taken sync:", [row["sync/probe_gap"] for row in rows], *caught, sep="\n")
    assert len(caught) == 2, output[-3000:]  # versions 2 and 4, each once before it is sent again
    for line, version in zip(caught, (2, 4), strict=True):
        found = re.search(rf"generator 0 serves other weights .* version {version}: .* by ([0-9.e-]+) per token", line)
        assert found and float(found[1]) > 1e-3, line  # the base's gap to the policy: far over the bound
        moved = re.search(r"\(over sync.probe_max_gap 0.001, and 0.1 of the ([0-9.e-]+) per token the learner's", line)
        assert moved and float(found[1]) > 0.1 * float(moved[1]), line  # and over a tenth of the learner's own move
        assert line.endswith(" moved since); sending every weight again"), line
    stop = next(line for line in output.splitlines() if line.startswith("grpo-dist: the run stopped: "))
    assert "generator 0 serves other weights than the learner's after the sync of version 4 and after every" in stop
    assert "Traceback" not in output


def peft_logprobs(policy, token_ids: list[int]) -> torch.Tensor:
    """[T-1] log-probability of each token after the first under `policy` (eval mode, float32)."""
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logits = policy.eval()(input_ids=ids).logits.float().log_softmax(-1)
    return logits[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]


@pytest.mark.slow
def test_an_engine_serving_adapters_holds_the_newest_versions_and_each_request_keeps_its_own(
    ray_cluster, model_dir, tmp_path
):
    """A generator built to serve adapters (rank 4 in a slot of rank 8; `rollout.max_staleness` 1: two versions held,
    a third while one comes in) is sent three adapters as versions 1-3 (each with its own random B: three policies).
    After each its log-probabilities are the ones PEFT computes with that adapter (and not the last one's); a group
    sampled while version 3 comes in finishes under version 2, its tokens' log-probabilities version 2's, and is
    labelled 2; only versions 2 and 3 stay loaded in the engine. The adapters' directory in shared memory is gone
    once the generator closes, and one a dead generator left (its pid gone) is removed when the next one starts; so
    is the directory of its engine's sockets."""
    import os
    import tempfile

    from grpo_dist.cluster.actors.generator import Generator
    from grpo_dist.models import lora as lora_module
    from grpo_dist.transports.base import adapter_slots
    from grpo_dist.types import Sampling

    lora = {"rank": 4, "alpha": 8}
    cfg = validate_config(
        small_config(tmp_path, rollout={"max_staleness": 1, "max_model_len": 160}, learner={"lora": lora})
    )
    assert adapter_slots(cfg) == (8, 3)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    left = tempfile.mkdtemp(prefix="grpo-dist-adapters-999999999-", dir=shm)  # no such pid
    sockets_left = tempfile.mkdtemp(prefix="grpo-dist-engine-sockets-999999999-")  # and of its engine's sockets
    generator = ray_cluster.remote(Generator).options(num_cpus=1)
    generator = generator.remote(model_dir, cfg.rollout, 0, None, None, ("best_effort", []), adapter_slots(cfg))
    ray_cluster.get(generator.start.remote())
    assert not os.path.exists(left) and not os.path.exists(sockets_left)
    pid = ray_cluster.get(generator.__ray_call__.remote(lambda self: os.getpid()))
    sockets = ray_cluster.get(generator.__ray_call__.remote(lambda self: os.environ["VLLM_RPC_BASE_PATH"]))
    assert os.path.basename(sockets).startswith(f"grpo-dist-engine-sockets-{pid}-") and os.listdir(sockets)
    (made,) = [name for name in os.listdir(shm) if name.startswith(f"grpo-dist-adapters-{pid}-")]
    sequence = [5, 9, 12, 7, 30, 3, 8, 11, 14, 2, 6, 13]
    policies, previous = {}, None
    for version in (1, 2, 3):
        policies[version] = policy = wrapped(model_dir, seed=version, **lora)
        if version == 3:  # a group of long completions under way as version 3 comes in
            sampling = Sampling(temperature=1.0, top_p=1.0, max_tokens=128)
            under_way = generator.generate.remote(sequence[:4], 8, sampling, 0, 0)
        adapter = (lora_module.adapter_state_dict(policy), lora_module.adapter_config(policy))
        elements, sent = ray_cluster.get(generator.load_adapter.remote(adapter, version))
        assert elements == sum(t.numel() for t in adapter[0].values()) and sent == 4 * elements  # float32
        got = torch.tensor(ray_cluster.get(generator.sequence_logprobs.remote(sequence)))
        torch.testing.assert_close(got, peft_logprobs(policy, sequence), atol=1e-4, rtol=1e-4)
        if previous is not None:
            assert not torch.allclose(got, previous, atol=1e-2)
        previous = got
    group = ray_cluster.get(under_way)
    assert {completion.weight_version for completion in group} == {2}
    assert {completion.newest_weight_version for completion in group} == {None}
    for completion in group:
        tokens = completion.prompt_token_ids + completion.token_ids
        want = peft_logprobs(policies[2], tokens)[len(completion.prompt_token_ids) - 1 :]
        torch.testing.assert_close(torch.tensor(completion.logprobs), want, atol=1e-4, rtol=1e-4)
    assert ray_cluster.get(generator.adapters_loaded.remote()) == [2, 3]
    assert sorted(os.listdir(os.path.join(shm, made))) == ["v2.2", "v3.3"]  # version.load
    ray_cluster.get(generator.close.remote())
    assert not os.path.exists(os.path.join(shm, made))
    assert not os.path.exists(sockets)  # the engine's sockets went with it, not left in the temporary directory
    ray_cluster.kill(generator)
