"""The memory plan (`grpo_dist.config.plan`, `grpo-dist plan`, part of `check`): parameters counted from a config.json
as
the model has them, the manual's sizing arithmetic, every shipped recipe fitting the GPUs it names, and configs that
do not fit refused with their numbers. The recipes' models are hub ids; their config.json files (the shapes
published with them, no weights) are put in a hub cache of the test's own and resolved offline."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from conftest import REPO, Ran, cli_batch, cli_here, small_config
from test_hub_models import cache_model

from grpo_dist.config import ConfigError, load_config, validate_config
from grpo_dist.config.plan import Shape

SHAPES = {  # config.json of each recipe's model: the fields a plan reads, as published
    "deepseek-ai/deepseek-math-7b-instruct": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 30, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 102400},
    "Qwen/Qwen2.5-Math-7B": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064},
    "Qwen/Qwen2.5-Coder-7B-Instruct": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064},
    "Qwen/Qwen3-8B": {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "head_dim": 128,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 151936},
    "Qwen/Qwen2.5-32B": {"model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 27648,
        "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064},
    "Qwen/Qwen2.5-VL-7B-Instruct": {"model_type": "qwen2_5_vl", "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
        "image_token_id": 151655, "video_token_id": 151656, "rope_scaling": {"type": "mrope",
        "mrope_section": [16, 24, 24]}, "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
        "intermediate_size": 3420, "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
        "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2, "temporal_patch_size": 2}},
}  # fmt: skip
RECIPES = ["grpo", "dr_grpo", "gspo", "dapo", "code", "geo3k"]


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shapes")
    for index, (repo_id, shape) in enumerate(SHAPES.items()):
        files = root / f"files-{index}"
        files.mkdir()
        (files / "config.json").write_text(json.dumps({**shape, "tie_word_embeddings": False}))
        cache_model(root / "hf", repo_id, files, f"{index:040x}", ["main"])
    return root / "hf"


REFUSALS = [  # (recipe, overrides, what the refusal says)
    ("grpo", ["learner.num_ranks=1"], "a learner rank needs 1"),  # 16 B x 6.9e9 on one GPU: over 100 GB
    ("dr_grpo", ["learner.micro_batch_size=32"], "a learner rank needs"),  # the activations of 128k tokens
    ("dapo", ["rollout.tensor_parallel_size=1", "rollout.gpu_memory_utilization=0.8"], "an engine needs"),  # 65 GB
    ("dapo", ["rollout.tensor_parallel_size=1", "rollout.dtype=float32"], "an engine needs 142.9 GB"),  # 4 B each
    ("gspo", ["cluster.gpu_memory_gb=24"], "more than the 24 GB of cluster.gpu_memory_gb"),
]
PINNED = (40, 60, 1)  # GB of KV cache per GPU: fits DAPO's engines (16.4 GB of weights in 72), does not, too small
CHECKED = ["check", str(REPO / "configs" / "grpo.yaml"), "learner.num_ranks=1"]


def plan_argv(recipe: str, *overrides: str) -> tuple[str, ...]:
    return ("plan", str(REPO / "configs" / f"{recipe}.yaml"), *overrides)


@pytest.fixture(scope="module")
def said(hf_home) -> dict[tuple[str, ...], Ran]:
    """What each command of this module's tests against the hub cache gives, by its arguments: every recipe's plan,
    the refusals, `check` of a recipe that does not fit, DAPO's engine at its model's dtype. Run in one process of
    their own (the hub's settings are read at import), not one each."""
    argvs = [plan_argv(recipe) for recipe in RECIPES] + [plan_argv(recipe, *more) for recipe, more, _ in REFUSALS]
    argvs += [plan_argv("dapo", "rollout.tensor_parallel_size=1", "rollout.dtype=auto"), tuple(CHECKED)]
    argvs += [plan_argv("dapo", f"rollout.kv_cache_gb={gb}") for gb in PINNED]
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    return dict(zip(argvs, cli_batch([list(argv) for argv in argvs], env=env), strict=True))


def test_parameters_are_counted_as_the_model_has_them(tmp_path):
    import torch  # noqa: F401  (transformers needs it to build the model)
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_dist.models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny", hidden_size=128, num_heads=2, num_layers=3, intermediate_size=256)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    assert Shape.of(model_dir).params == sum(parameter.numel() for parameter in model.parameters())


def test_the_readme_sizing_table_is_the_one_the_plan_prints():
    """The sizing table of docs/scaling.md is what `benchmarks/sizing.py` makes of the plan today."""
    made = sizing()
    table = made.table()
    assert len(table) == 2 + len(made.ROWS)
    assert "\n".join(table) in (REPO / "docs" / "scaling.md").read_text()


def sizing():
    """benchmarks/sizing.py: the sizing table and the plan set beside DeepSpeed's estimators."""
    spec = importlib.util.spec_from_file_location("sizing", REPO / "benchmarks" / "sizing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model", ["0.5B", "7B", "32B"])  # Qwen2.5-0.5B (tied embeddings), -Math-7B, -32B
def test_model_states_are_within_5_percent_of_deepspeeds_estimators_on_the_real_module(model):
    """DeepSpeed's estimators fed the module itself (built on the meta device: shapes, no weights), counted the way
    its `*_all_live` helpers count (total parameters, the largest module's own), against the plan, which has only
    config.json: per-GPU model states and host memory for ZeRO-2 and -3, with and without offload, 4 and 8 ranks."""
    cases = sizing().deepspeed_cases(model)
    assert len(cases) == 10
    for each in cases:
        for ours, theirs in (each["gpu"], each["host"]):
            assert ours == pytest.approx(theirs, rel=0.05), each


def cache_dir(hf_home: Path, repo_id: str) -> Path:
    (snapshot,) = (hf_home / "hub" / f"models--{repo_id.replace('/', '--')}" / "snapshots").iterdir()
    return snapshot


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_fits_the_gpus_it_names(said, recipe):
    config = REPO / "configs" / f"{recipe}.yaml"
    assert load_config(config).model.path in SHAPES  # a hub id whose shape is known here
    result = said[plan_argv(recipe)]
    assert result.returncode == 0, result.stdout + result.stderr
    assert "learner rank:" in result.stdout and "engine at bfloat16:" in result.stdout
    if recipe == "geo3k":  # Qwen2.5-VL-7B as published: 8.29B parameters, 0.68B of them its vision tower
        assert "(8.29B parameters, 0.68B of them the vision tower, 80 GB GPUs)" in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("recipe", "overrides", "message"),
    REFUSALS,
    ids=["7b-on-one-rank", "micro-batch-too-big", "32b-engine-without-tp", "32b-engine-in-float32", "small-gpus"],
)
def test_a_config_that_does_not_fit_is_refused_with_its_numbers(said, recipe, overrides, message):
    result = said[plan_argv(recipe, *overrides)]
    assert result.returncode == 2, result.stdout
    assert message in result.stderr and "does not fit" in result.stdout
    assert "Traceback" not in result.stderr


def test_a_cpu_run_has_nothing_to_plan(capfd, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(small_config(tmp_path)))
    result = cli_here(capfd, "plan", str(config), cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "learner ranks on CPUs" in result.stdout and "engines on CPUs" in result.stdout


def test_check_refuses_a_config_that_does_not_fit_before_reading_its_data(said):
    """`check` (and `train`) plan right after resolving the model: the recipe's data files are not even read."""
    result = said[tuple(CHECKED)]
    assert result.returncode == 2
    assert "the config does not fit its GPUs: a learner rank needs" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_a_model_the_plan_does_not_know_is_said_so_and_not_refused(tmp_path, capsys):
    """A mixture of experts: the dense arithmetic would undercount its parameters, so the plan is skipped with a
    line, and the config is not refused."""
    from grpo_dist.config.plan import check_plan

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "vocab_size": 16,
                                                      "num_hidden_layers": 1, "num_attention_heads": 1}))  # fmt: skip
    cfg = validate_config(small_config(tmp_path, learner={"num_gpus": 1}))
    assert check_plan(cfg, str(tmp_path)) is not None  # llama's own default intermediate size: planned
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 64, "num_experts": 8}))
    assert check_plan(cfg, str(tmp_path)) is None
    assert "memory plan: not made for this model (qwen3_moe is a mixture of experts)" in capsys.readouterr().out


def test_the_readme_shows_the_plan_dapo_prints(said):
    """The plan printed in docs/scaling.md ("Sizing") is the one `grpo-dist plan configs/dapo.yaml` prints."""
    readme = (REPO / "docs" / "scaling.md").read_text()
    start = readme.index("memory plan per GPU (32.76B")
    shown = readme[start : readme.index("```", start)].strip().splitlines()
    printed = said[plan_argv("dapo")].stdout.strip().splitlines()
    assert printed[-len(shown) :] == shown


def test_an_engine_is_planned_at_the_dtype_it_runs_in(said):
    """`rollout.dtype: auto` (the default) runs a GPU engine in the model's own 16-bit dtype, and the plan counts 2 B
    a weight; float32 doubles that: DAPO's 32B engine on one GPU fits in bfloat16 and not in float32 (the refusal
    above). On CPUs auto is float32, where generator and learner logprobs agree."""
    from grpo_dist.cluster.actors.engine import engine_dtype
    from grpo_dist.config.sections import RolloutConfig

    assert RolloutConfig().dtype == "auto"
    assert engine_dtype(RolloutConfig(), on_gpu=False) == "float32"
    assert engine_dtype(RolloutConfig(), on_gpu=True) == "auto"
    assert engine_dtype(RolloutConfig(dtype="bfloat16"), on_gpu=False) == "bfloat16"
    result = said[plan_argv("dapo", "rollout.tensor_parallel_size=1", "rollout.dtype=auto")]
    assert result.returncode == 0, result.stdout + result.stderr
    assert "engine at the model's dtype: 71.4 of 72.0 GB (weights 65.5" in result.stdout, result.stdout


@pytest.mark.parametrize("targets", [None, ["q_proj", "down_proj"]], ids=["default-modules", "two-modules"])
def test_a_lora_adapter_is_counted_as_peft_builds_it(tmp_path, targets):
    """The plan's count of an adapter's parameters is the number PEFT trains on a model of that config.json."""
    import torch  # noqa: F401  (transformers needs it to build the model)
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_dist.config.sections import LoraConfig
    from grpo_dist.models import lora

    shape = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(shape))
    adapter = LoraConfig(rank=4, **({"target_modules": targets} if targets else {}))
    policy = lora.wrap(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path)), adapter)
    trained = sum(param.numel() for param in policy.parameters() if param.requires_grad)
    assert Shape.of(tmp_path).adapter_params(adapter) == trained > 0


def test_lora_plans_the_frozen_base_and_no_reference(tmp_path, capsys):
    """A 7B policy on one 80 GB GPU: refused for full training (weights, gradients and Adam states: 16 B and more a
    parameter), planned with LoRA at its frozen bf16 weights, the adapter's states and no reference copy."""
    from grpo_dist.config.plan import check_plan

    (tmp_path / "config.json").write_text(json.dumps(SHAPES["Qwen/Qwen2.5-Math-7B"]))
    full = load_config(REPO / "configs" / "grpo.yaml", ["learner.num_ranks=1"])
    with pytest.raises(ConfigError, match="a learner rank needs"):
        check_plan(full, str(tmp_path))
    overrides, model = ["learner.num_ranks=1", "learner.lora={}"], str(tmp_path)
    adapted = load_config(REPO / "configs" / "grpo.yaml", overrides)
    capsys.readouterr()
    result = check_plan(adapted, model)
    out = capsys.readouterr().out
    assert result is not None and not result.problems(), out
    assert "40.4M trained by LoRA" in out and "reference" not in out, out
    # the base's bf16 weights, the adapter's states (0.7 GB) and ZeRO-3's buffer for the largest layer it gathers
    # (the embedding, 2.2 GB); full training's were over 100 GB
    base_gb = 2 * result.params / 1e9
    assert base_gb + 2.9 < result.learner["model states"] < base_gb + 3
    # Engines serving the adapter hold max_staleness + 2 slots of rank 16 on every linear layer of each block, in
    # bf16: 2 x 40.4M x 2 B at k = 0, 3 x at k = 1; served merged, none.
    assert result.engine["LoRA slots"] == pytest.approx(2 * 40.4e6 * 2 / 1e9, rel=1e-3)
    stale = check_plan(load_config(REPO / "configs" / "grpo.yaml", [*overrides, "rollout.max_staleness=1"]), model)
    assert stale.engine["LoRA slots"] == pytest.approx(3 * 40.4e6 * 2 / 1e9, rel=1e-3)
    merged = check_plan(load_config(REPO / "configs" / "grpo.yaml", [*overrides, "learner.lora.serve=merged"]), model)
    assert "LoRA slots" not in merged.engine and merged.kv_room_tokens > result.kv_room_tokens


def test_a_pinned_kv_cache_is_planned_whole_and_refused_where_it_cannot_fit(said):
    """`rollout.kv_cache_gb` fixes the engines' cache in bytes: the plan counts all of it beside the weights, gives
    the tokens it holds (DAPO's 32B model: 2 x 64 layers x 8 KV heads x 128 x 2 B = 262,144 B a token, spread over
    the engine's four GPUs: 40 GB x 4 / 262,144 B) and refuses a cache that leaves no room for the weights or holds
    less than one whole sequence; without it the plan says vLLM sizes the cache."""
    from grpo_dist.cluster.actors.engine import kv_cache_bytes
    from grpo_dist.config.sections import RolloutConfig

    fits, too_big, too_small = (said[plan_argv("dapo", f"rollout.kv_cache_gb={gb}")] for gb in PINNED)
    assert fits.returncode == 0, fits.stdout + fits.stderr
    assert "(weights 16.4, KV cache (pinned) 40.0); KV room 610,351 tokens" in fits.stdout, fits.stdout
    assert "KV cache: pinned at 40 GB per GPU (rollout.kv_cache_gb)" in fits.stdout
    assert "engine at bfloat16: 56.4 of 72.0 GB" in fits.stdout  # weights 16.4 + the cache, not one sequence's
    assert too_big.returncode == 2 and "an engine needs 76.4 GB per GPU (weights and its pinned KV cache)" in (
        too_big.stderr
    ), too_big.stderr
    assert "lower rollout.kv_cache_gb" in too_big.stderr
    assert too_small.returncode == 2 and "holds less than one whole sequence (1.48 GB" in too_small.stderr
    assert "KV cache: sized by vLLM at start" in said[plan_argv("dapo")].stdout
    assert kv_cache_bytes(RolloutConfig(), on_gpu=True) is None  # left to vLLM
    assert kv_cache_bytes(RolloutConfig(cpu_kv_cache_gib=0.5), on_gpu=False) == 2**29  # the CPU backend's, as before
