"""Config: YAML + dotted overrides, errors that name the key, and nothing heavy imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, cli_here, small_config

from grpo_dist.config import ConfigError, apply_override, load_config, validate_config
from grpo_dist.config.reference import field_docs

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def write_config(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_bundled_configs_are_valid(path):
    assert load_config(path).run.steps >= 1


def test_overrides_are_parsed_as_yaml_values(tmp_path):
    path = write_config(tmp_path, small_config(tmp_path))
    cfg = load_config(path, ["learner.lr=5e-6", "rollout.group_size=8", "algorithm.dual_clip=3", "ray.address=null"])
    assert (cfg.learner.lr, cfg.rollout.group_size, cfg.algorithm.dual_clip, cfg.ray.address) == (5e-6, 8, 3.0, None)


@pytest.mark.parametrize(
    "override, message",
    [
        pytest.param("learner.lrr=1e-5", "learner.lrr: unknown key (did you mean learner.lr?)", id="typo-in-key"),
        pytest.param("rollout.grup_size=4", "did you mean rollout.group_size?", id="typo-in-nested-key"),
        pytest.param("lerner.lr=1e-5", "lerner: unknown key (did you mean learner?)", id="typo-in-section"),
        pytest.param("reward.functions=[{name: math_answer, wieght: 1}]",
                     "reward.functions.0.wieght: unknown key (did you mean reward.functions.0.weight?)",
                     id="typo-in-list-item"),
        pytest.param("rollout.group_size=1", "rollout.group_size: Input should be greater than or equal to 2",
                     id="group-too-small"),
        pytest.param("learner.lr=fast", "learner.lr: Input should be a valid number", id="not-a-number"),
        pytest.param("algorithm.estimator=ppo", "algorithm.estimator: Input should be 'grpo'", id="unknown-choice"),
        pytest.param("learner.zero_stage=4", "learner.zero_stage", id="zero-stage"),
        pytest.param("algorithm.dual_clip=0.5", "algorithm.dual_clip: Input should be greater than 1", id="dual-clip"),
        pytest.param("model.tiny.hidden_size=100", "hidden_size / num_heads must be 64", id="head-dim"),
    ],
)  # fmt: skip
def test_bad_values_name_the_key(tmp_path, override, message):
    path = write_config(tmp_path, small_config(tmp_path))
    with pytest.raises(ConfigError) as error:
        load_config(path, [override])
    assert message in str(error.value)
    assert str(path) in str(error.value)


def test_every_problem_is_reported_at_once(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(write_config(tmp_path, small_config(tmp_path)), ["learner.lrr=1", "rollout.top_p=2"])
    assert "learner.lrr" in str(error.value) and "rollout.top_p" in str(error.value)


@pytest.mark.parametrize(
    "override, key",
    [
        pytest.param("reward.timeout_s=.inf", "reward.timeout_s", id="yaml-inf-timeout"),
        pytest.param("reward.timeout_s=inf", "reward.timeout_s", id="bare-inf-timeout"),
        pytest.param("algorithm.eps=.nan", "algorithm.eps", id="yaml-nan-eps"),
        pytest.param("algorithm.eps=nan", "algorithm.eps", id="bare-nan-eps"),
        pytest.param("reward.functions.1.weight=-.inf", "reward.functions.1.weight", id="minus-inf-weight"),
        pytest.param("faults.score_timeout_s=.inf", "faults.score_timeout_s", id="inf-bound"),
        pytest.param("learner.betas=[0.9, .nan]", "learner.betas.1", id="nan-in-a-tuple"),
        pytest.param("algorithm.is_cap=.inf", "algorithm.is_cap", id="inf-in-a-union"),
        pytest.param("reward.functions.0.kwargs={scale: [1, .inf]}", "reward.functions.0.kwargs: Value error, "
                     "kwargs.scale.1 is not a finite number", id="inf-in-kwargs"),
    ],
)  # fmt: skip
def test_a_number_that_is_not_finite_is_refused_naming_its_key(tmp_path, override, key):
    """`.inf`/`.nan` bound, weigh and limit nothing: refused wherever they are, from a file or an override."""
    with pytest.raises(ConfigError) as error:
        load_config(write_config(tmp_path, small_config(tmp_path)), [override])
    assert f"\n  {key}" in str(error.value) and "finite number" in str(error.value)


def test_a_non_finite_number_in_the_file_itself_is_refused(tmp_path):
    path = write_config(tmp_path, small_config(tmp_path, reward={"timeout_s": float("inf")}))
    assert "timeout_s: .inf" in path.read_text()  # as YAML writes it
    with pytest.raises(ConfigError, match=r"reward.timeout_s: Input should be a finite number \(got inf\)"):
        load_config(path)


@pytest.mark.parametrize(
    "name", ["", ".", "..", "../elsewhere", "a/b", "/abs", "a\\b", "a\0b"], ids=["empty", "dot", "dotdot",
    "parent", "slash", "absolute", "backslash", "nul"]
)  # fmt: skip
def test_run_name_must_be_one_plain_path_component(tmp_path, name):
    with pytest.raises(ConfigError) as error:
        validate_config(small_config(tmp_path, run={"name": name}))
    assert "run.name: Value error, must be one plain path component" in str(error.value)


def test_a_plain_run_name_is_its_own_directory_under_output_dir(tmp_path):
    cfg = validate_config(small_config(tmp_path, run={"name": "grpo-7b.v2 run"}))
    assert cfg.run_dir.parent == tmp_path / "outputs" and cfg.run_dir.name == "grpo-7b.v2 run"


@pytest.mark.parametrize("setting, key", [("isolation", "reward.isolation"), ("memory_mb", "reward.sandbox_memory_mb"),
                                          ("budget_s", "reward.timeout_s")])  # fmt: skip
def test_the_jail_takes_its_settings_from_the_reward_section_not_kwargs(tmp_path, setting, key):
    functions = [{"name": "code_tests", "kwargs": {setting: "best_effort", "timeout_per_test_s": 1.0}}]
    with pytest.raises(ConfigError) as error:
        validate_config(small_config(tmp_path, reward={"functions": functions}))
    assert f"reward.functions.0.kwargs.{setting}: code_tests's jail takes it from {key}" in str(error.value)


@pytest.mark.parametrize(
    "raw, message",
    [
        pytest.param({"model": {"path": "m"}, "reward": {"functions": [{"name": "math_answer"}]}, "data": {}},
                     "set either data.path", id="no-data-source"),
        pytest.param({"model": {"path": "m"}, "data": {"path": "x.jsonl"}}, "reward: required key is missing",
                     id="missing-section"),
        pytest.param({"model": {"path": "m"}, "data": {"path": "x.jsonl"}, "reward": {"functions": []}},
                     "reward.functions: List should have at least 1 item", id="no-reward-function"),
    ],
)  # fmt: skip
def test_structural_errors(raw, message):
    with pytest.raises(ConfigError, match="invalid config") as error:
        validate_config(raw)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "override, message",
    [
        pytest.param("learner", "must look like section.key=value", id="no-equals"),
        pytest.param("learner.lr.x=1", "'lr' holds a value, not a section", id="value-as-section"),
        pytest.param("reward.functions.2.weight=1", "reward.functions is a list of 2 items, indexed 0 to 1, not '2'",
                     id="index-past-the-end"),
        pytest.param("reward.functions.first.weight=1", "reward.functions is a list of 2 items", id="not-an-index"),
    ],
)  # fmt: skip
def test_malformed_overrides(override, message):
    raw = {"learner": {"lr": 1.0}, "reward": {"functions": [{"name": "a"}, {"name": "b"}]}}
    with pytest.raises(ConfigError, match=message):
        apply_override(raw, override)


def test_an_override_reaches_an_item_of_a_list(tmp_path):
    """`reward.functions.1.weight=0.5` sets the second reward function's weight, and nothing else."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(small_config(tmp_path)))
    before = load_config(config).reward.functions
    cfg = load_config(config, ["reward.functions.1.weight=0.25", "reward.functions.0.name=math_answer"])
    assert [(f.name, f.weight) for f in cfg.reward.functions] == [
        ("math_answer", before[0].weight),
        (before[1].name, 0.25),
    ]
    assert before[1].weight != 0.25


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_every_field_is_documented():
    undocumented = [key for key, _, doc in field_docs() if not doc.strip()]
    assert undocumented == []


def test_config_and_cli_import_neither_torch_nor_ray():
    code = "import sys, grpo_dist.cli; print(sorted(m for m in ('torch', 'ray', 'vllm') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_driver_picks_the_transport_and_reads_a_sync_report_without_loading_vllm(tmp_path):
    """The driver resolves `sync.transport: auto` and unpickles what a gloo sync reports (a learner's answer); it
    never runs vLLM, so neither loads it (seconds of every run's start-up). It reads a tiny model's tokenizer without
    importing transformers' auto classes (seconds more)."""
    import pickle

    from grpo_dist.models.tiny import build_tiny_model
    from grpo_dist.transports.base import SyncReport

    path = write_config(tmp_path, small_config(tmp_path))
    model = build_tiny_model(tmp_path / "model")
    report = pickle.dumps(SyncReport("full", 10, 10, 40))
    code = (
        "import pickle, sys; import grpo_dist.run.driver; from grpo_dist.config import load_config; "
        "from grpo_dist.transports import transport_name; from grpo_dist.run.inputs import load_tokenizer; "
        f"load_tokenizer({str(model)!r}); "
        f"print(transport_name(load_config({str(path)!r})), pickle.loads({report!r}).mode, 'vllm' in sys.modules, "
        "'transformers.models.auto.tokenization_auto' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["broadcast", "full", "False", "False"]


def test_a_check_reads_a_tiny_models_tokenizer_and_config_without_importing_torch(tmp_path):
    """`grpo-dist check` builds a config's tiny model in a directory it then removes, only to read its tokenizer and
    config.json: without its weights, neither torch nor transformers' model classes are imported (3 of a check's 6 s
    on 2 cores), and what the config asks beyond the model's positions is still refused."""
    path = write_config(
        tmp_path, small_config(tmp_path, reward={"functions": [{"name": "math_answer", "weight": 1.0}]})
    )
    code = (
        "import sys; from grpo_dist.cli import main; "
        "codes = [main(['check', sys.argv[1]]), main(['check', sys.argv[1], 'rollout.max_model_len=300'])]; "
        "print(codes, [name for name in ('torch', 'transformers.models.auto.modeling_auto') if name in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert result.stdout.splitlines()[-1] == "[0, 2] []", result.stdout + result.stderr
    assert "the 256 positions of the model (max_position_embeddings in" in result.stderr, result.stderr
    assert "tokenizer and config" in result.stdout and not (tmp_path / "model").exists()


def test_cli_reports_a_typo_before_starting_anything(capfd, tmp_path):
    path = write_config(tmp_path, small_config(tmp_path))
    result = cli_here(capfd, "train", str(path), "learner.lrr=1e-5")
    assert result.returncode == 2
    assert "learner.lrr: unknown key (did you mean learner.lr?)" in result.stderr
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    ("setting", "on_gpu", "expected"),
    [(None, False, True), (None, True, False), (True, True, True), (False, False, False)],
    ids=["auto-cpu", "auto-gpu-cuda-graphs", "asked-eager", "asked-graphs"],
)
def test_engines_use_cuda_graphs_on_a_gpu_unless_asked_to_run_eagerly(tmp_path, setting, on_gpu, expected):
    from grpo_dist.cluster.actors.engine import eager

    rollout = validate_config(small_config(tmp_path, rollout={"enforce_eager": setting})).rollout
    assert eager(rollout, on_gpu) is expected


def grpo_dist_cli(*args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "grpo_dist", *args]
    return subprocess.run(command, stdout=stdout, stderr=subprocess.PIPE, text=True, check=False)


def test_cli_errors_are_one_line_never_a_traceback(capfd, tmp_path):
    missing = cli_here(capfd, "plot", str(tmp_path / "none.jsonl"), str(tmp_path / "c.png"))
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0
    assert f"{tmp_path / 'none.jsonl'}: no such metrics file" in missing.stderr
    (tmp_path / "bad.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2,\n')
    malformed = cli_here(capfd, "plot", str(tmp_path / "bad.jsonl"), str(tmp_path / "c.png"))
    assert malformed.returncode == 2 and f"{tmp_path / 'bad.jsonl'}:2: not a metrics row" in malformed.stderr
    assert "Traceback" not in missing.stderr + malformed.stderr
    # A reader that has stopped reading (`| head -1`) has closed the pipe: the command ends quietly, exit 0 (its
    # interpreter's last flush included: a process of its own).
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        closed = grpo_dist_cli("reference", stdout=write_end)
    finally:
        os.close(write_end)
    assert closed.returncode == 0 and closed.stderr == "", closed.stderr


def test_a_check_whose_reader_left_still_gives_its_verdict(tmp_path):
    """`grpo-dist check CONFIG | head -1`: the reader leaves after the first line, and the check goes on to its end:
    data it cannot read is still exit 2 (not the 0 of a command cut short), a good config still checked through."""
    rewards = {"functions": [{"name": "math_answer", "weight": 1.0}]}
    good = small_config(tmp_path, reward=rewards)
    bad = small_config(tmp_path, reward=rewards, data={"task": None, "path": str(tmp_path / "absent.jsonl")})
    said = {}
    for name, raw, code in [("bad.yaml", bad, 2), ("good.yaml", good, 0)]:
        (tmp_path / name).write_text(yaml.safe_dump(raw))
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            checked = grpo_dist_cli("check", str(tmp_path / name), stdout=write_end)
        finally:
            os.close(write_end)
        assert checked.returncode == code, checked.stderr
        assert "Traceback" not in checked.stderr and "BrokenPipe" not in checked.stderr, checked.stderr
        said[name] = checked.stderr
    assert "absent.jsonl" in said["bad.yaml"]  # the reason still reaches the user, on stderr


def test_resume_followed_by_an_override_is_an_override(monkeypatch, tmp_path):
    from grpo_dist import cli

    seen = []
    monkeypatch.setattr(cli, "_run", lambda args: seen.append((args.resume, args.overrides)) or 0)
    cli.main(["train", "c.yaml", "--resume", "learner.lr=1e-6"])
    cli.main(["train", "c.yaml", "run.steps=3", "--resume", str(tmp_path)])
    cli.main(["train", "c.yaml", "--resume"])
    assert seen == [(True, ["learner.lr=1e-6"]), (str(tmp_path), ["run.steps=3"]), (True, [])]
