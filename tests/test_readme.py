"""The README and the site's pages (docs/) are the user's manual: the configuration page is written from the code at
every build, the build is strict, and every command, make target, config and file the manual names must be real
(parsed by the real command line, loaded by the real config loader)."""

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
from conftest import REPO, SERIAL_MARK, TESTS_DIR

from grpo_dist import cli
from grpo_dist.cli import reference_markdown
from grpo_dist.config import load_config

README = (REPO / "README.md").read_text()
PAGES = sorted((REPO / "docs").glob("*.md"))
MANUAL = "\n".join([README, *(page.read_text() for page in PAGES)])  # the front page and the site's pages
FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def commands(lines: list[str]) -> list[str]:
    """The `grpo-dist ...` and `make ...` commands among `lines`, comments dropped."""
    return [shlex.join(shlex.split(line, comments=True)) for line in lines if line.startswith(("grpo-dist ", "make "))]


CODE_COMMANDS = commands([line.strip() for block in FENCED.findall(MANUAL) for line in block.splitlines()])
COMMANDS = list(dict.fromkeys(CODE_COMMANDS + commands(re.findall(r"`([^`\n]+)`", FENCED.sub("", MANUAL)))))
# Files of the repository the README names: links, images, `benchmarks/learning.py --seeds 5`, `.ci/run`, ...
REPO_PATH = re.compile(r"(?<![\w./-])((?:\.ci|benchmarks|cluster|configs|docker|docs|grpo_dist|tests)/[\w./-]*\w)")
NAMED_PATHS = sorted(set(REPO_PATH.findall(MANUAL)))
NAMED_CONFIGS = [path for path in NAMED_PATHS if path.startswith("configs/")]


def make_targets() -> set[str]:
    makefile = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", makefile, re.MULTILINE))


def test_the_serial_phase_collects_the_modules_that_mark_serial_tests_and_a_mark_it_would_miss_is_refused(tmp_path):
    """`make test`'s serial phase is given the modules whose text holds `SERIAL_MARK`, every one of them; a test
    marked serial in a module without that text (the mark built another way) stops the collection, naming it."""
    dry = subprocess.run(["make", "-n", "-o", f"{sys.prefix}/.installed", "test", f"VENV={sys.prefix}"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    [serial] = [
        words for command in dry.stdout.replace("||", ";").split(";") if "serial" in (words := shlex.split(command))
    ]
    marking = sorted(f"tests/{path.name}" for path in TESTS_DIR.glob("test_*.py") if SERIAL_MARK in path.read_text())
    assert serial[serial.index("serial") + 1 :] == marking and len(marking) >= 2, serial

    # the mark written as a module writes it, kept out of this module's own text (the serial phase would collect it)
    (tmp_path / "test_seen.py").write_text(f"import pytest\n\n@{SERIAL_MARK}\ndef test_seen():\n    pass\n")
    (tmp_path / "test_hidden.py").write_text(
        'import pytest\nmark = getattr(pytest.mark, "ser" + "ial")\n\n@mark\ndef test_hidden():\n    pass\n'
    )
    collect = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "serial", "-p", "conftest", "-c",
               str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), "-p", "no:cacheprovider"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(TESTS_DIR), "PYTEST_ADDOPTS": ""}  # (a harness's plugins not asked for)
    seen = subprocess.run([*collect, "test_seen.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert seen.returncode == 0 and "1 test collected" in seen.stdout, seen.stdout + seen.stderr
    both = subprocess.run([*collect, "test_seen.py", "test_hidden.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    told = both.stdout + both.stderr
    assert both.returncode != 0 and "marked serial, but" in told and "test_hidden.py::test_hidden" in told, told
    assert "test_seen.py::test_seen" not in told.split("marked serial, but", 1)[1], told


def test_the_configuration_page_is_the_schema_written_at_every_build(tmp_path):
    """The site's configuration page is generated from the code when the site is built (`mkdocs_hooks.py`); the
    build is strict, so a broken link or anchor anywhere in the manual fails it."""
    page = (REPO / "docs" / "configuration.md").read_text()
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                           cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ,
                           "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(REPO)})  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    html = (tmp_path / "site" / "configuration" / "index.html").read_text()
    keys = re.findall(r"^\| `([\w.\[\]]+)` \|", reference_markdown(), re.MULTILINE)
    assert len(keys) > 100 and all(f"<code>{key}</code>" in html for key in keys)
    assert "<!-- grpo-dist reference --markdown -->" in page and "| `run.steps` |" not in page  # written, not pasted


def test_a_broken_link_fails_the_docs_build(tmp_path):
    """The strict build is a check that can fail: the same pages with one link to a missing anchor do not build."""
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path)
    shutil.copy(REPO / "mkdocs_hooks.py", tmp_path)
    (tmp_path / "docs" / "install.md").write_text((tmp_path / "docs" / "install.md").read_text()
                                                    + "\n[gone](sandbox.md#no-such-section)\n")  # fmt: skip
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1",
                           "PYTHONPATH": str(REPO)})  # fmt: skip
    assert built.returncode != 0 and "no-such-section" in built.stdout + built.stderr


def test_the_front_page_is_short_and_links_every_page():
    assert len(README.splitlines()) <= 250
    for page in PAGES:
        assert f"](docs/{page.name})" in README or page.name == "index.md", f"README links no {page.name}"


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
    section = (REPO / "docs" / "own-data.md").read_text().split("## Training your own model", 1)[1].split("\n## ", 1)[0]
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
