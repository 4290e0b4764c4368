"""Shared fixtures: a local Ray cluster for the integration tests and a small config for the real loop."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).parent
REPO = TESTS_DIR.parent


_session_warm: tuple[Path, subprocess.Popen] | None = None


def session_warm_process() -> Path | None:
    """The socket of this test process's warm process (`grpo_dist.cluster.warm`), started on first use and killed
    with this process: the session's Ray cluster forks its actors from it, and so do the runs the tests start as
    commands with clusters of their own (`warm_shared_env`), which would each import the stack once more in a warm
    process of their own. None where workers cannot start warm."""
    global _session_warm
    from grpo_dist.cluster import warm

    if not warm.available():
        return None
    if _session_warm is None or _session_warm[1].poll() is not None:
        import atexit

        _stop_session_warm()  # one that died: its directory
        _session_warm = warm.start_in_new_dir("grpo-dist-tests-warm-")
        atexit.unregister(_stop_session_warm)
        atexit.register(_stop_session_warm)
    return _session_warm[0]


def session_warm_pid() -> int | None:
    """The pid of this test process's warm process, None where `session_warm_process` started none."""
    return _session_warm[1].pid if _session_warm is not None else None


def session_warm_environ() -> dict[str, str]:
    """The environment the session's warm process started with (`session_warm_process` started it): the values of
    the variables read at import that it imported the stack under."""
    import psutil

    assert _session_warm is not None, "no session warm process: call session_warm_process first"
    return psutil.Process(_session_warm[1].pid).environ()


def _stop_session_warm() -> None:
    global _session_warm
    from grpo_dist.cluster import warm

    if _session_warm is not None:
        stopped, _session_warm = _session_warm, None
        warm.stop_and_remove(*stopped)


def warm_shared_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a command that starts a run (`train`, `eval`, `sft`): its driver forked from the session's warm
    process (`grpo_dist.cluster.warm_driver`), and a run on a local cluster of its own forks its actors from it too
    (`grpo_dist.cluster.warm.SHARED_ENV`), where each would import the stack once more. The variables read at import
    (`warm.IMPORT_ENV`) are given the values that process imported the stack with (a run in this process may have set
    some since), else the driver would start cold. A test that finds a run's actors among its driver's descendants
    leaves them out: forked from the session's process, they are not the driver's; `driver_of` finds a forked driver."""
    from grpo_dist.cluster import warm

    socket_path = session_warm_process()
    if socket_path is None:
        return env
    imported = {key: value for key, value in session_warm_environ().items() if key.startswith(warm.IMPORT_ENV)}
    return {**{key: value for key, value in env.items() if not key.startswith(warm.IMPORT_ENV)}, **imported,
            warm.SHARED_ENV: str(socket_path)}  # fmt: skip


def driver_of(command: subprocess.Popen, timeout_s: float = 60.0):
    """The process that runs `command`'s run (a `python -m grpo_dist train ...` started with `warm_shared_env`): the
    driver the session's warm process forked for it (its child, titled as the command), or the command's own process
    where it runs its driver itself. A test that kills the driver kills this one: killing the command ends its
    forked driver too, but a moment later."""
    import time

    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        if (forked := _forked_driver(command)) is not None:
            return forked
        with contextlib.suppress(OSError):
            if "libtorch" in Path(f"/proc/{command.pid}/maps").read_text():  # it imports the stack: its own driver
                return psutil.Process(command.pid)
        assert command.poll() is None and time.monotonic() < deadline, f"no driver found for {command.args}"
        time.sleep(0.05)


def kill_run(command: subprocess.Popen) -> None:
    """SIGKILL to `command`'s process group (started with `start_new_session`) and to its forked driver's, if any (in
    a session of its own): what a failed test leaves is gone at once, not when the driver notices."""
    forked = _forked_driver(command)
    for group in [command.pid] + ([forked.pid] if forked is not None else []):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


def _forked_driver(command: subprocess.Popen):
    """The driver the session's warm process forked for `command`, while it lives; else None."""
    import psutil

    title = " ".join(["grpo-dist", *map(str, command.args[3:])])
    warm_pid = session_warm_pid()
    try:
        children = psutil.Process(warm_pid).children() if warm_pid is not None else []
    except psutil.Error:
        return None
    for child in children:
        with contextlib.suppress(OSError, UnicodeDecodeError):  # its title, as `ps` shows it (psutil splits it)
            if Path(f"/proc/{child.pid}/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").decode() == title:
                return child
    return None


HEAD_NODE = {"num_cpus": 0, "include_dashboard": False}
"""`ray.cluster_utils.Cluster`'s `head_node_args` for a test's own cluster whose head holds no actor: and no dashboard,
which no test of those reads and which polls the cluster all along (Ray's dashboards took 4 % of a suite's CPU)."""


def headed_cluster():
    """A test's own `ray.cluster_utils.Cluster`, not connected: its head as `HEAD_NODE` says, started without the
    API server Ray would start for its usage statistics alone (`lean_local_node`)."""
    from ray.cluster_utils import Cluster

    from grpo_dist.cluster.ray_cluster import lean_local_node

    with lean_local_node():
        return Cluster(initialize_head=True, connect=False, head_node_args=HEAD_NODE)


def warm_nodes() -> contextlib.AbstractContextManager:
    """Within the block, the Ray nodes this process starts (`ray.cluster_utils.Cluster`, its head and `add_node`) fork
    their workers from the session's warm process instead of starting them cold. For tests that look for no actor
    among a node's processes: a forked worker is the warm process's child, not the raylet's."""
    from grpo_dist.cluster import warm

    socket_path = session_warm_process()
    return warm.used_for_nodes_started_here(socket_path) if socket_path is not None else contextlib.nullcontext()


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for every integration test; its workers can import tests/reward_fixtures.py."""
    import ray

    from grpo_dist.cluster import warm
    from grpo_dist.cluster.ray_cluster import start_local_ray

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
    os.environ.setdefault("WANDB_MODE", "offline")
    env = {"TOKENIZERS_PARALLELISM": "false"}
    only_this_cluster = contextlib.nullcontext()
    if (socket_path := session_warm_process()) is not None:  # the session's actors forked from one process
        only_this_cluster = warm.used_for_nodes_started_here(socket_path)  # a test's own: cold, unless `warm_nodes`
    with only_this_cluster:
        start_local_ray(num_cpus=16, runtime_env={"env_vars": env})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def s3():
    """The URI of a bucket on an S3 server on this machine, every S3 client of this process pointed at it."""
    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
        for name, value in [("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test")]:
            patch.setenv(name, value)
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        patch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        endpoint = {"endpoint_override": f"{host}:{port}", "scheme": "http", "region": "us-east-1"}
        pafs.S3FileSystem(allow_bucket_creation=True, **endpoint).create_dir("bucket")
        yield "s3://bucket/runs"
    server.stop()


def train_here(capfd, config, *overrides: str, cluster=None, resume: bool | str = False) -> tuple[int, str]:
    """`grpo-dist train CONFIG OVERRIDES` in this process, on the session's Ray cluster (`ray_cluster`): the command's
    checks and messages, without a Ray cluster of its own or a second import of the stack, for the runs a test
    neither kills nor signals. Given a `cluster` (`SharedActors.use`), the run uses those actors instead of starting its
    own, resuming as `resume` says (`--resume`'s values). Returns the exit code and everything printed."""
    from grpo_dist import cli
    from grpo_dist.config import load_config
    from grpo_dist.run import driver

    capfd.readouterr()
    stdout, sigterm = sys.stdout, signal.getsignal(signal.SIGTERM)
    try:
        if cluster is None:
            flags = ["--resume", *([resume] if isinstance(resume, str) else [])] if resume else []
            code = cli.main(["train", str(config), *overrides, *flags])
        else:
            driver.train(load_config(config, list(overrides)), cluster, resume=resume)
            code = 0
    finally:
        sys.stdout = stdout  # the command guards its standard output against a closed reader; this process's is kept
        signal.signal(signal.SIGTERM, sigterm)
    out, err = capfd.readouterr()
    return code, out + err


def train_config_here(capfd, tmp_path: Path, raw: dict) -> tuple[int, str]:
    """`train_here` on the config `raw`, written to tmp_path/run.yaml: a run on the session's Ray cluster (the test
    takes `ray_cluster`) with its own actors, for the runs whose exit code and console a test reads and that it
    neither kills nor signals. Returns the exit code and everything printed."""
    import yaml

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    return train_here(capfd, config)


@dataclass
class Ran:
    """What a command run by `cli_here` gave: its exit code and everything it printed, as `subprocess.run` reports
    a command's."""

    returncode: int
    stdout: str
    stderr: str
    started_ray: bool = False  # `cli_here`: whether the command started or joined a Ray cluster


def cli_here(capfd, *argv: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> Ran:
    """`python -m grpo_dist ARGV` in this process, in `cwd`, with `env` added to the environment: the command's own
    checks, messages and exit code (an argument error's too) without paying a new interpreter's imports (8 to 12 s a
    command on 2 busy cores). For commands that start no Ray cluster of their own and that no test signals; the
    process's environment, working directory, standard output and SIGTERM handler are as they were afterwards.
    `started_ray` says whether the command called `ray.init` (where this process is on the session's cluster
    already) or left Ray initialized (where it was not)."""
    from grpo_dist import cli

    capfd.readouterr()
    stdout, sigterm, environ, here = sys.stdout, signal.getsignal(signal.SIGTERM), dict(os.environ), Path.cwd()
    ray, inits = sys.modules.get("ray"), []
    if ray is not None:
        init = ray.init
        ray.init = lambda *args, **kwargs: inits.append(args) or init(*args, **kwargs)
    try:
        os.environ.update(env or {})
        os.chdir(cwd or here)
        try:
            code = cli.main(list(argv))
        except SystemExit as exit:  # argparse's refusals
            code = exit.code if isinstance(exit.code, int) else 2
    finally:
        if ray is not None:
            ray.init = init
        sys.stdout = stdout
        signal.signal(signal.SIGTERM, sigterm)
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(here)
    out, err = capfd.readouterr()
    started = bool(inits) if ray is not None else "ray" in sys.modules and sys.modules["ray"].is_initialized()
    return Ran(code, out, err, started)


def cli_batch(argvs: list[list[str]], cwd: Path = REPO, env: dict[str, str] | None = None) -> list[Ran]:
    """`python -m grpo_dist ARGV` for each of `argvs`, one after another in one new process (in `cwd`, with `env`
    added to the environment): for commands that need an environment of their own (settings libraries read at
    import) and change nothing another reads, one interpreter's imports instead of one per command. What each
    gave, in order. The tests' reward functions can be imported."""
    command = [sys.executable, str(TESTS_DIR / "cli_batch.py"), json.dumps(argvs)]
    path = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))  # the reward fixtures
    done = subprocess.run(command, cwd=cwd, env={**os.environ, "PYTHONPATH": path, **(env or {})},
                          capture_output=True, text=True, timeout=300 + 60 * len(argvs))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [Ran(*each) for each in json.loads(done.stdout.splitlines()[-1])]


class SharedActors:
    """One set of actors at a time, kept between the runs of a module that can use it (`use`): its runs, one after
    another, start actors only when a run asks for others (another model, placement or engine:
    `grpo_dist.cluster.cluster.differences`) or the last run on them failed. `model_path` is a tiny model they all
    share."""

    def __init__(self, model_path: Path) -> None:
        self.model_path, self.cluster = model_path, None

    def config(self, raw: dict) -> dict:
        """`raw` (a `small_config`) reading the shared tiny model, so that its actors can be shared."""
        return {**raw, "model": {"path": str(self.model_path), "tiny": {}}}

    @contextmanager
    def use(self, cfg) -> Iterator:
        """Actors for a run of `cfg`: the kept ones when they can run it, else new ones (the kept ones stopped); a
        failure in the block stops them, so that no run takes over actors a failure left behind."""
        from grpo_dist.cluster.cluster import Cluster, differences
        from grpo_dist.run.inputs import prepare

        model_path = prepare(cfg).model_path
        kept = self.cluster
        if kept is None or differences(kept.cfg, kept.model_path, cfg, model_path):
            self.close()
            self.cluster = Cluster.start(cfg, model_path)
        try:
            yield self.cluster
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            cluster.shutdown()


@pytest.fixture(scope="module")
def shared_actors(ray_cluster, tmp_path_factory) -> Iterator[SharedActors]:
    """The actors a module's runs share (`SharedActors`), on the session's Ray cluster; stopped when the module's
    tests are done, so that no idle set holds memory and cores while the other modules run."""
    shared = SharedActors(tmp_path_factory.mktemp("shared") / "model")
    yield shared
    shared.close()


def written_checkpoint(path: Path, raw: dict) -> Path:
    """A checkpoint directory at `path` as one learner rank writes it (empty shards, a run state, the config of
    `raw`, a manifest): enough for `grpo_dist.run.checkpoints.find` and `check_config`."""
    import yaml

    from grpo_dist.config import validate_config
    from grpo_dist.storage import manifest

    (path / "learner" / "state").mkdir(parents=True)
    (path / "learner" / "state" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (path / "learner" / "state" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    (path / "run_state.pt").write_bytes(b"")
    (path / "config.yaml").write_text(yaml.safe_dump(validate_config(raw).model_dump(mode="json")))
    manifest.write(path)
    return path


def injected(raw: dict, **inject) -> dict:
    """`raw` with the faults `inject` names injected (`faults.inject`), its other fault settings kept."""
    return {**raw, "faults": {**raw.get("faults", {}), "inject": inject}}


def small_config(tmp_path: Path, **sections) -> dict:
    """A raw config for a few fast steps of the real loop on a tiny model (sections override whole keys)."""
    raw = {
        "run": {"name": "test", "output_dir": str(tmp_path / "outputs"), "steps": 3, "seed": 0},
        "model": {"path": str(tmp_path / "model"), "tiny": {}},
        "data": {
            "task": {"name": "last_digit", "num_train": 64, "num_eval": 8},
            "max_prompt_tokens": 16,
            "prompts_per_step": 4,
        },
        "rollout": {"group_size": 4, "max_new_tokens": 4, "max_model_len": 32, "cpu_kv_cache_gib": 0.05},
        "reward": {
            "num_workers": 2,
            "timeout_s": 5,
            "functions": [
                {"name": "reward_fixtures.first_char_reward", "weight": 1.0},
                {"name": "math_answer", "weight": 0.5},
            ],
        },
        "algorithm": {"kl_coef": 0.04},
        "learner": {"lr": 1e-2, "micro_batch_size": 6, "zero_stage": 2},
        "eval": {"max_prompts": 8},
        "wandb": {"enabled": False},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return raw


LONGEST = ("test_resume", "test_faults", "test_learning", "test_overlap", "test_checkpoint_safety", "test_storage",
           "test_agents", "test_watching", "test_learner", "test_submit", "test_recipes", "test_readme",
           "test_loop")  # fmt: skip
"""The modules whose tests take longest together, longest first (16.5 to 2 minutes each on 2 cores: `make test`'s
durations, summed by module): started first, they leave the short modules to fill in at the end. The Makefile turns
off pytest-xdist's own order (most tests first), which would put these behind modules of many short tests."""


def pytest_configure(config):
    """Refuse to run beside a cluster `grpo-dist up` started: the runs the tests start without a cluster of their
    own would join it, and the tests that count the machine's processes would count its. The clusters the tests
    start themselves (`ray start`, `ray.cluster_utils`) run their actors at grpo-dist's priority, without Ray's
    metrics. Under pytest-xdist each worker and its runs take their share of the machine's cores
    (`GRPO_DIST_CPU_SHARE`): two workers' torch threads each spin-waiting for cores the other holds make both several
    times slower."""
    from grpo_dist.cluster import ray_settings, standing

    for name, value in ray_settings.cluster_environment().items():  # the clusters the tests start by hand
        os.environ.setdefault(name, value)  # as grpo-dist's own
    if (workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")).isdigit():  # side by side on the cores
        import torch

        os.environ.setdefault("GRPO_DIST_CPU_SHARE", workers)  # ray_cluster.CPU_SHARE_ENV (it imports Ray)
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(workers)))  # this worker's own torch work
    if (found := standing.find()) is not None:
        raise pytest.UsageError(
            f"a local Ray cluster of `grpo-dist up` is up ({found.address}): the tests' runs would join it; "
            "stop it with `grpo-dist down` first"
        )


SERIAL_MARK = "pytest.mark.serial"
"""How a module marks a test serial: the Makefile's serial phase collects only the modules whose text holds it."""


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: every serial test is seen
def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu(n)` (n CUDA GPUs, 1 when not given) are skipped where fewer are present. Under pytest-xdist
    (`make test`: `--dist loadfile`, a module's tests on one worker, sharing its fixtures: a Ray cluster, engines, a
    trained model) the longest modules go first (`LONGEST`), then those with the most real-stack tests, so that no
    long one is left to run alone at the end. A test marked serial in a module the Makefile's serial phase would
    not collect (its text lacks `SERIAL_MARK`) is refused: it would run in neither phase."""
    hidden = sorted({item.nodeid for item in items if item.get_closest_marker("serial") is not None
                     and SERIAL_MARK not in item.path.read_text()})  # fmt: skip
    if hidden:
        raise pytest.UsageError(f"marked serial, but its module's text lacks {SERIAL_MARK!r}, which the Makefile's "
                                f"serial phase looks for: {', '.join(hidden)}")  # fmt: skip

    slow = {}
    for item in items:
        module = item.path.stem
        slow[module] = slow.get(module, 0) + (item.get_closest_marker("slow") is not None)

    def order(item) -> tuple:
        module = item.path.stem
        first = LONGEST.index(module) if module in LONGEST else len(LONGEST)
        return first, -slow[module]

    items.sort(key=order)  # stable: each module's own order kept

    if not any(item.get_closest_marker("gpu") is not None for item in items):
        return  # torch not imported for nothing (a collection of a few modules, as test_readme's)
    import torch

    present = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        needed = marker.args[0] if marker is not None and marker.args else 1
        if marker is not None and present < needed:
            gpus = f"{needed} CUDA GPU{'s' if needed > 1 else ''}"
            item.add_marker(pytest.mark.skip(reason=f"needs {gpus}, {present} present"))
