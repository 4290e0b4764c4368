"""The README is the user's manual: its config reference must be the one the code defines, and every command, make
target, config and file it names must be real (parsed by the real command line, loaded by the real config loader)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from grpo_dist import cli
from grpo_dist.cli import reference_markdown
from grpo_dist.config import load_config

README = (REPO / "README.md").read_text()
FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def commands(lines: list[str]) -> list[str]:
    """The `grpo-dist ...` and `make ...` commands among `lines`, comments dropped."""
    return [shlex.join(shlex.split(line, comments=True)) for line in lines if line.startswith(("grpo-dist ", "make "))]


CODE_COMMANDS = commands([line.strip() for block in FENCED.findall(README) for line in block.splitlines()])
COMMANDS = list(dict.fromkeys(CODE_COMMANDS + commands(re.findall(r"`([^`\n]+)`", FENCED.sub("", README)))))
# Files of the repository the README names: links, images, `benchmarks/learning.py --seeds 5`, `.ci/run`, ...
REPO_PATH = re.compile(r"(?<![\w./-])((?:\.ci|benchmarks|cluster|configs|docker|docs|grpo_dist|tests)/[\w./-]*\w)")
NAMED_PATHS = sorted(set(REPO_PATH.findall(README)))
NAMED_CONFIGS = [path for path in NAMED_PATHS if path.startswith("configs/")]


def make_targets() -> set[str]:
    makefile = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", makefile, re.MULTILINE))


def test_readme_config_reference_matches_the_schema():
    assert reference_markdown() in README, "README is stale: paste `grpo-dist reference --markdown` into it"


def test_readme_quick_start_is_the_two_make_commands():
    quick_start = README.split("## Quick start", 1)[1]
    first_block = FENCED.search(quick_start).group(1)
    assert commands(first_block.splitlines()) == ["make demo", "make test"]


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.startswith("make ")])
def test_each_make_command_of_the_readme_names_a_makefile_target(command):
    # `make install EXTRA=gpu`: words with `=` set variables, the others are targets
    targets = [word for word in shlex.split(command)[1:] if "=" not in word and not word.startswith("-")]
    assert targets, command
    assert set(targets) <= make_targets(), f"README: `{command}`: no such target in the Makefile"


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.startswith("grpo-dist ")], ids=str)
def test_each_grpo_dist_command_of_the_readme_parses(command, monkeypatch, capsys):
    """The real parser of `grpo-dist`, nothing run. A bare `grpo-dist train` in prose names a subcommand: its
    `--help` must exit 0. A command in a code block with a real config file also loads it, overrides applied."""
    argv = shlex.split(command)[1:]
    parsed = []
    monkeypatch.setattr(cli, "_run", lambda args: parsed.append(args) or 0)
    try:
        cli.main(argv if len(argv) > 1 else [*argv, "--help"])
    except SystemExit as stop:  # argparse exits 0 after --help, 2 on an unknown subcommand, flag or missing argument
        assert stop.code == 0 and len(argv) == 1, f"README: `{command}` does not parse:\n{capsys.readouterr().err}"
        return
    (args,) = parsed
    config = getattr(args, "config", None)
    if command in CODE_COMMANDS and config is not None:
        assert (REPO / config).is_file(), f"README: `{command}`: no config file {config}"
        load_config(REPO / config, args.overrides)


def test_the_readme_names_commands_configs_and_benchmarks():
    """The checks above and below see what the README holds (a changed pattern would leave them nothing to check)."""
    assert {"make demo", "make test", "make test-fast", "make lint"} <= set(COMMANDS)
    assert sum(command.startswith("grpo-dist ") for command in CODE_COMMANDS) >= 8
    assert {"configs/quickstart.yaml", "configs/grpo.yaml", "configs/gspo.yaml"} <= set(NAMED_CONFIGS)
    assert {"benchmarks/learning.py", "benchmarks/vs_trl.py", "benchmarks/overlap.py"} <= set(NAMED_PATHS)


@pytest.mark.parametrize("path", NAMED_PATHS)
def test_each_file_the_readme_names_exists(path):
    assert (REPO / path).exists(), f"README names {path}, which is not in the repository"


@pytest.mark.parametrize("path", NAMED_CONFIGS)
def test_each_config_the_readme_names_loads(path):
    assert load_config(REPO / path).run.steps >= 1


@pytest.mark.slow
def test_training_your_own_model_runs_as_written(tmp_path):
    """The README's walkthrough, step by step in a directory of its own: the Python that saves the dataset, then each
    command of the block after it, as they are written there."""
    section = README.split("## Training your own model", 1)[1].split("\n## ", 1)[0]
    python, commands_block = FENCED.findall(section)[:2]
    (tmp_path / "configs").mkdir()
    shutil.copy(REPO / "configs" / "own_data.yaml", tmp_path / "configs")
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    env.pop("RAY_ADDRESS", None)
    subprocess.run([sys.executable, "-c", python], cwd=tmp_path, env=env, check=True, timeout=300)
    lines = [line for line in commands_block.splitlines() if line.strip()]
    assert [shlex.split(line, comments=True)[:2] for line in lines] == [["grpo-dist", "check"], ["grpo-dist", "train"]]
    outputs = []
    for line in lines:
        done = subprocess.run(line, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"`{line}` failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        outputs.append(done.stdout)
    assert "first prompt, as the model reads it: 'Add the numbers.\\n\\n" in outputs[0]
    rows = [json.loads(line) for line in (tmp_path / "outputs" / "own-data" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 7))
    assert (tmp_path / "outputs" / "own-data" / "final" / "model.safetensors").is_file()
