"""`grpo-dist sft`: the supervised warm-up learns its task, saves a model training starts from, refuses bad input."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml
from conftest import small_config
from transformers import AutoModelForCausalLM

from grpo_dist.cli import main
from grpo_dist.config import ConfigError, load_config
from grpo_dist.data import DatasetError
from grpo_dist.run.inputs import prepare_model
from grpo_dist.run.sft import run_sft

ACCURACY = re.compile(r"held-out accuracy (before|after) warm-up: ([0-9.]+)")


def sft_config(tmp_path, **sections):
    defaults = {
        "data": {"task": {"name": "last_digit", "num_train": 512, "num_eval": 50}, "max_prompt_tokens": 16},
        "rollout": {"max_new_tokens": 2},
        "eval": {"max_prompts": 50},
        "sft": {"base": str(tmp_path / "base"), "steps": 150, "batch_size": 32, "lr": 3e-3},
    }
    raw = small_config(tmp_path, **{**defaults, **sections})
    raw["model"]["tiny"] = {"characters": "0123456789 :"}
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_warm_up_learns_the_task_and_writes_a_model_training_starts_from(tmp_path, capsys):
    config = sft_config(tmp_path)
    cfg = load_config(config)
    with pytest.raises(ConfigError, match="grpo-dist sft CONFIG"):
        prepare_model(cfg)  # training refuses to start before the warm-up wrote model.path

    out_dir = run_sft(cfg)

    accuracy = dict(ACCURACY.findall(capsys.readouterr().out))
    # Copying the digit before ":" is easy supervised: 150 steps of 32 rows take a random model from chance (~0.1)
    # to nearly always right.
    assert float(accuracy["before"]) < 0.3
    assert float(accuracy["after"]) >= 0.9
    assert out_dir == tmp_path / "model" and not (tmp_path / "model.partial").exists()
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    tuned = AutoModelForCausalLM.from_pretrained(out_dir)
    changed = [
        name
        for (name, before), (_, after) in zip(base.named_parameters(), tuned.named_parameters(), strict=True)
        if not torch.equal(before, after)
    ]
    assert len(changed) == len(list(base.parameters()))
    assert prepare_model(cfg) == str(out_dir.resolve())


def test_the_warm_up_takes_its_share_of_the_cores_where_runs_share_them(tmp_path, monkeypatch):
    """With GRPO_DIST_CPU_SHARE=K, the warm-up's torch threads are the cores divided by K, as a learner rank's: all of
    them, each spin-waiting for cores another run holds, made two runs side by side several times slower."""
    import os

    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: nothing to share")
    before = torch.get_num_threads()
    torch.set_num_threads(cores)
    monkeypatch.setenv("GRPO_DIST_CPU_SHARE", str(cores))
    try:
        small = {
            "data": {"task": {"name": "last_digit", "num_train": 64, "num_eval": 4}, "max_prompt_tokens": 16},
            "eval": {"max_prompts": 4},
            "sft": {"base": str(tmp_path / "base"), "steps": 2, "batch_size": 4},
        }
        run_sft(load_config(sft_config(tmp_path, **small)))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_warm_up_refuses_to_overwrite_a_model_unless_asked(tmp_path, capsys):
    config = sft_config(tmp_path, sft={"base": str(tmp_path / "base"), "steps": 2, "batch_size": 4})
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "keep.txt").write_text("mine")
    assert main(["sft", str(config)]) == 2
    assert "exists already" in capsys.readouterr().err
    assert (tmp_path / "model" / "keep.txt").read_text() == "mine"
    assert main(["sft", str(config), "--overwrite"]) == 0
    assert (tmp_path / "model" / "config.json").is_file() and not (tmp_path / "model" / "keep.txt").exists()


def test_a_config_without_an_sft_section_is_refused(tmp_path, capsys):
    raw = small_config(tmp_path)
    (tmp_path / "plain.yaml").write_text(yaml.safe_dump(raw))
    assert main(["sft", str(tmp_path / "plain.yaml")]) == 2
    assert "no sft section" in capsys.readouterr().err
    assert not (tmp_path / "model").exists()


def test_a_row_without_an_answer_is_named_before_training(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"prompt": "1 2:", "answer": "2"}) + "\n" + json.dumps({"prompt": "3 4:"}) + "\n")
    config = sft_config(tmp_path, data={"path": str(train), "task": None})
    with pytest.raises(DatasetError, match=r"train.jsonl: row 2: no answer column 'answer' \(data.fields.answer"):
        run_sft(load_config(config))
    assert not (tmp_path / "model").exists()
