"""What a run checks before any actor starts (`grpo_dist.run.inputs`, shared by `train`, `sft` and `check`), and how it
keeps earlier runs."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import cli_here, small_config

from grpo_dist.config import ConfigError, validate_config
from grpo_dist.data import DatasetError
from grpo_dist.run.inputs import prepare
from grpo_dist.storage.run_dir import open_run, start_run_dir


@pytest.fixture
def bad_dataset(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "1 2:", "answer": "2"}\n{"prompt": "3 4:", "answer": "4"\n')
    return path


def config_with_dataset(tmp_path, path):
    raw = small_config(tmp_path)
    raw["data"] = {"path": str(path), "max_prompt_tokens": 16, "prompts_per_step": 4}
    raw["reward"] = {"functions": [{"name": "math_answer"}]}
    return raw


def test_malformed_row_is_reported_with_file_and_line_before_ray_starts(tmp_path, bad_dataset, monkeypatch):
    import ray

    started = []
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: started.append(args))  # whether or not Ray is up
    cfg = validate_config(config_with_dataset(tmp_path, bad_dataset))
    with pytest.raises(DatasetError, match=rf"{bad_dataset}:2: "):
        prepare(cfg)
    assert not started


@pytest.mark.parametrize("command", ["train", "check"])
def test_cli_exits_with_the_dataset_error(capfd, tmp_path, bad_dataset, command):
    """`check` reads the data as `train` does: a config it passes does not fail later on its rows."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(config_with_dataset(tmp_path, bad_dataset)))
    result = cli_here(capfd, command, str(config))
    assert result.returncode == 2
    assert f"{bad_dataset}:2:" in result.stderr
    assert not result.started_ray  # refused before any cluster starts


def test_check_catches_what_train_would_fail_on_and_writes_nothing(capfd, tmp_path):
    """A misspelt reward fails `check` as it would fail `train`; a good config passes with its inputs counted, the
    tiny model and the task data built in a scratch directory, not at model.path or in the run directory."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(small_config(tmp_path, reward={"functions": [{"name": "math_anwser"}]})))
    result = cli_here(capfd, "check", str(config))
    assert result.returncode == 2 and "Did you mean 'math_answer'?" in result.stderr
    config.write_text(yaml.safe_dump(small_config(tmp_path)))
    result = cli_here(capfd, "check", str(config))
    assert result.returncode == 0, result.stderr
    assert "inputs: 64 training prompts, eval sets held_out (8 prompts)" in result.stdout
    assert not (tmp_path / "model").exists() and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    "section, values, message",
    [
        pytest.param("reward", {"functions": [{"name": "math_anwser"}]}, "Did you mean 'math_answer'?", id="reward"),
        pytest.param("eval", {"reward": "no_such.module.fn"}, "no_such.module.fn", id="eval-reward"),
        pytest.param("rollout", {"max_model_len": 16}, "exceeds rollout.max_model_len (16)", id="length-budget"),
        pytest.param("rollout", {"max_model_len": 512}, "above the 256 positions of the model", id="positions"),
        pytest.param(
            "data", {"prompts_per_step": 65}, "data.prompts_per_step (65) is more than the 64", id="step-over-dataset"
        ),
    ],
)
def test_bad_inputs_fail_in_prepare(tmp_path, section, values, message):
    cfg = validate_config(small_config(tmp_path, **{section: values}))
    with pytest.raises(ConfigError) as error:
        prepare(cfg)
    assert message in str(error.value)


def test_a_reward_that_does_not_import_is_said_before_what_else_is_wrong(tmp_path):
    """The pre-flight's sandbox imports the reward functions while the data loads; its refusal still comes first."""
    cfg = validate_config(small_config(tmp_path, eval={"reward": "no_such.module.fn"}, data={"prompts_per_step": 65}))
    with pytest.raises(ConfigError, match="no_such.module.fn"):
        prepare(cfg)


ROWS = [{"prompt": f"{n} {n}:", "answer": str(n)} for n in range(4)]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("field", ["memory_mb", "isolation", "budget_s", "timeout_per_test_s", "strict"])
def test_a_row_carrying_a_jail_setting_is_refused_naming_the_row_and_field_before_ray_starts(
    tmp_path, monkeypatch, field
):
    """A row's fields reach the rewards as keyword arguments: one named as a setting of the jail (lifting its memory
    cap, dropping `require`, stretching its time) is refused before anything starts, not passed on."""
    import ray

    started = []
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: started.append(args))
    rows = [dict(row) for row in ROWS]
    rows[2][field] = {"memory_mb": 1 << 20, "isolation": "best_effort"}.get(field, 1e9)
    path = write_rows(tmp_path / "train.jsonl", rows)
    with pytest.raises(ConfigError) as refused:
        prepare(validate_config(config_with_dataset(tmp_path, path)))
    assert f"data.path: row 2 (0-based) of {path} has the field {field!r}, a name reserved" in str(refused.value)
    assert not started


def test_an_eval_sets_row_carrying_a_jail_setting_is_refused_naming_its_key(tmp_path):
    raw = config_with_dataset(tmp_path, write_rows(tmp_path / "train.jsonl", ROWS))
    held = write_rows(tmp_path / "held.jsonl", [*ROWS[:1], {**ROWS[1], "isolation": "best_effort"}])
    raw["eval"] = {"sets": [{"name": "held", "path": str(held)}]}
    with pytest.raises(ConfigError) as refused:
        prepare(validate_config(raw))
    assert f"eval.sets.0.path: row 1 (0-based) of {held} has the field 'isolation'" in str(refused.value)


def test_a_renamed_prompt_field_is_read(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"question": "1 2:", "answer": "2"}\n')
    raw = config_with_dataset(tmp_path, path)
    raw["data"].update(fields={"prompt": "question"}, prompts_per_step=1)
    inputs = prepare(validate_config(raw))
    assert [(r.text, r.fields) for r in inputs.train] == [("1 2:", {"answer": "2"})]


def test_missing_model_directory(tmp_path):
    raw = small_config(tmp_path)
    raw["model"] = {"path": str(tmp_path / "absent")}
    with pytest.raises(ConfigError, match="is not a Hugging Face model directory"):
        prepare(validate_config(raw))


def test_an_earlier_run_is_moved_aside_not_overwritten(tmp_path):
    cfg, run = open_run(validate_config(small_config(tmp_path)))
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    start_run_dir(cfg, run)
    kept = [p for p in cfg.run_dir.parent.iterdir() if p.name.startswith("test-")]
    assert len(kept) == 1 and (kept[0] / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in cfg.run_dir.iterdir()) == ["config.yaml"]


def test_a_failed_preflight_check_leaves_no_run_directory_and_the_earlier_run_in_place(tmp_path):
    from grpo_dist.run.driver import train

    cfg = validate_config(small_config(tmp_path, data={"prompts_per_step": 65}))
    with pytest.raises(ConfigError):
        train(cfg)
    assert not cfg.run_dir.exists()
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError):
        train(cfg)
    assert [p.name for p in cfg.run_dir.parent.iterdir() if p.name.startswith("test")] == ["test"]
    assert (cfg.run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_an_unreachable_ray_address_fails_at_once_naming_it(tmp_path):
    from grpo_dist.cluster.ray_cluster import start_ray

    cfg = validate_config(small_config(tmp_path, ray={"address": "127.0.0.1:1"}))
    with pytest.raises(ConnectionError, match=r"ray.address: cannot reach the Ray cluster at 127.0.0.1:1"):
        start_ray(cfg)


@pytest.mark.slow
def test_an_unreachable_ray_address_fails_even_in_a_process_already_connected_to_ray(tmp_path, ray_cluster):
    from grpo_dist.cluster.ray_cluster import start_ray

    cfg = validate_config(small_config(tmp_path, ray={"address": "127.0.0.1:1"}))
    with pytest.raises(ConnectionError, match=r"ray.address: cannot reach the Ray cluster at 127.0.0.1:1"):
        start_ray(cfg)
    assert start_ray(validate_config(small_config(tmp_path))) is False  # the caller's connection is kept, not ended


def test_a_relative_output_dir_is_made_absolute_once_against_the_drivers_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    loaded = validate_config(small_config(tmp_path, run={"output_dir": "outputs"}, checkpoint={"dir": "ckpt"}))
    cfg, run = open_run(loaded)
    assert cfg.run_dir == run.work == tmp_path.resolve() / "outputs" / "test"  # what every actor then writes under
    assert run.store.name("test") == str(tmp_path.resolve() / "outputs" / "test")
    assert run.checkpoints.name(run.checkpoints_key) == str(tmp_path.resolve() / "ckpt")
    assert (loaded.run.output_dir, loaded.checkpoint.dir) == ("outputs", "ckpt")  # the loaded config is not changed
    monkeypatch.chdir(tmp_path / "..")
    again, _ = open_run(cfg)  # already absolute: unchanged wherever it is called from
    assert again.run_dir == tmp_path.resolve() / "outputs" / "test"


def test_a_qwen2_tokenizer_loads_without_the_auto_classes_as_they_would_load_it(tmp_path):
    """`load_tokenizer` loads a `Qwen2Tokenizer` named by a model type transformers maps to it without importing
    `AutoTokenizer` (test_config checks the import): the same tokenizer as `AutoTokenizer`'s. Files that name other
    code, or a model type mapped elsewhere, go through `AutoTokenizer`."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    from grpo_dist.models.tiny import build_tiny_model
    from grpo_dist.run.inputs import QWEN2_TOKENIZER_MODELS, load_tokenizer, qwen2_tokenizer

    assert {TOKENIZER_MAPPING_NAMES[name] for name in QWEN2_TOKENIZER_MODELS} == {"Qwen2Tokenizer"}
    model = build_tiny_model(tmp_path / "model")
    direct, auto = load_tokenizer(str(model)), AutoTokenizer.from_pretrained(model)
    assert qwen2_tokenizer(model) and type(direct) is type(auto)
    assert direct.get_vocab() == auto.get_vocab() and direct.all_special_tokens == auto.all_special_tokens
    assert (direct.pad_token_id, direct.eos_token_id, direct.chat_template) == (
        auto.pad_token_id, auto.eos_token_id, auto.chat_template
    )  # fmt: skip
    for text in ["7 3 9 5:", "12 <eos> 3", ""]:
        assert direct(text)["input_ids"] == auto(text)["input_ids"]
    for file, change in [("tokenizer_config.json", {"auto_map": {"AutoTokenizer": ["x.Tok", None]}}),
                         ("config.json", {"model_type": "llama"}),
                         ("tokenizer_config.json", {"tokenizer_class": "LlamaTokenizer"}),
                         ("config.json", {"_name_or_path": "deepseek-ai/deepseek-coder-1.3b"})]:  # fmt: skip
        other = tmp_path / f"other-{len(list(tmp_path.iterdir()))}"
        other.mkdir()
        for each in model.iterdir():
            (other / each.name).write_bytes(each.read_bytes())
        (other / file).write_text(json.dumps({**json.loads((model / file).read_text()), **change}))
        assert not qwen2_tokenizer(other), change
