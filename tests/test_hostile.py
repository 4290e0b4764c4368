"""Attacks, as a policy under RL (or a hostile reward or tool) would try them, each through the path a reward worker
or a generator scores and runs with: the model's code in `code_tests` and the `python` tool, user reward functions
in the sandbox. Each asserts the effect: the completion scores 0 (or is unscored, saying why), the secret was not
read, the process outside is alive, nothing was written, other calls score as they should, nothing is left running.
The same attacks run with namespaces refused (a `bwrap` that fails as a machine refusing them does), under
`best_effort`; under `require` that refusal stops a run before anything starts."""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from conftest import cli_here, small_config
from test_sandbox import runner_of, sandboxed_processes

from grpo_dist.agents.protocol import ToolCall
from grpo_dist.agents.tools import ToolBox, tool_spec
from grpo_dist.sandbox import NOBODY, jail, privileges
from grpo_dist.sandbox import Limits as SandboxLimits
from grpo_dist.types import Failure

SECRET = "wandb-secret-3f9a"  # the run's token, in this process's environment for every test here
TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(-1, 1) == 0"]
WRONG = "def add(a, b):\n    return 0\n"  # passes the last test only
REFUSED = "bwrap: No permissions to creating new namespace, likely because the kernel does not allow it\n"


@pytest.fixture(autouse=True)
def secrets_in_the_environment(monkeypatch, tmp_path_factory):
    """The run's secrets as a worker has them: a token in its environment, a credentials file only root reads."""
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    secret_file = tmp_path_factory.getbasetemp() / "netrc"
    secret_file.write_text(f"machine api.wandb.ai password {SECRET}\n")
    secret_file.chmod(0o600)
    monkeypatch.setenv("HOSTILE_SECRET_FILE", str(secret_file))
    yield secret_file


@pytest.fixture(params=["namespaces", "refused"])
def isolation(request, tmp_path, monkeypatch):
    """`require` on this machine; then `best_effort` on one that refuses namespaces."""
    if request.param == "refused":
        fake = tmp_path / "bin" / "bwrap"
        fake.parent.mkdir()
        fake.write_text(f"#!/bin/sh\nprintf '{REFUSED}' >&2\nexit 1\n")
        fake.chmod(0o755)
        monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    jail.status.cache_clear()
    yield "require" if request.param == "namespaces" else "best_effort"
    monkeypatch.undo()
    jail.status.cache_clear()


@pytest.fixture(scope="module", autouse=True)
def reaping_only_here():
    yield
    privileges.reap_orphans_here(False)


@pytest.fixture
def bystander():
    """A process outside the sandbox, of the worker's user: the attacks try to kill it."""
    process = subprocess.Popen(["sleep", "600"])
    yield process
    process.kill()
    process.wait()


def score(completion: str, isolation: str, tests=TESTS, timeout_s=30.0, **kwargs) -> tuple[float, Failure | None]:
    runner = runner_of(["code_tests"], timeout_s=timeout_s, isolation=isolation)
    try:
        total, _, errors = runner.score([0], [1.0], [{"timeout_per_test_s": 2.0, **kwargs}], "add", completion,
                                        {"tests": tests})  # fmt: skip
        return total, errors[0]
    finally:
        runner.close()


def solves_if(condition: str) -> str:
    """A completion that solves the task only when `condition` (Python, run after its attack) holds."""
    return f"def add(a, b):\n    return a + b if ({condition}) else 0\n"


FORGERIES = {
    "exit-0": WRONG + "import os\nos._exit(0)\n",
    "sys-exit": WRONG + "import sys\nsys.exit(0)\n",
    "raise-systemexit-in-finally": WRONG + "try:\n    pass\nfinally:\n    raise SystemExit(0)\n",
    "every-fd": WRONG + "import os\nlines = (b'up\\n', b'ran\\n', b'1.0\\n', b'{\"id\": 1, \"value\": 1.0}\\n')\n"
    "for fd in range(1024):\n    for line in lines:\n        try:\n            os.write(fd, line)\n"
    "        except OSError:\n            pass\n",
    "frames": WRONG + "import sys\nframe = sys._getframe()\nwhile frame is not None:\n"
    "    for name, value in frame.f_globals.items():\n        if 'nonce' in name or 'test' in name:\n"
    "            raise SystemExit(0)\n    frame = frame.f_back\n",
    "read-stdin-for-the-tests": WRONG + "import sys\nseen = sys.stdin.read()\n",
    "kill-its-parent": WRONG + "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
}


@pytest.mark.parametrize("completion", FORGERIES.values(), ids=FORGERIES.keys())
def test_code_that_forges_its_verdict_gets_the_score_of_what_it_solves(completion, isolation):
    """Each of these fails two tests of three; no way out of the protocol passes them."""
    blocks = "stdin.read()" in completion  # each test waits out its bound: 1 s of it is as telling as 2
    total, error = score(completion, isolation, **({"timeout_per_test_s": 1.0} if blocks else {}))
    assert total in (0.0, pytest.approx(1 / 3)) and error is None, (total, error)
    assert score(solves_if("True"), isolation) == (1.0, None)  # the honest answer is scored as ever


def test_the_tests_are_not_in_the_process_while_the_code_runs(isolation):
    """The code looks for the tests everywhere it can (its frames, every container in the interpreter) and answers
    them by lookup: it finds none, so it solves nothing (reading standard input is among `FORGERIES`)."""
    looks = (
        "import gc, sys\nneedle = 'assert ' + 'add'\n"
        "def strings(value):\n    if isinstance(value, dict):\n        value = list(value.values())\n"
        "    if isinstance(value, (list, tuple)):\n        return [v for v in value if isinstance(v, str)]\n"
        "    return []\n"
        "found = [text for o in gc.get_objects() for text in strings(o)]\nframe = sys._getframe()\n"
        "while frame is not None:\n    found += strings(frame.f_locals) + strings(frame.f_globals)\n"
        "    frame = frame.f_back\nSEEN = any(needle in text and text is not needle for text in found)\n"
    )
    assert score(looks + solves_if("SEEN"), isolation) == (pytest.approx(1 / 3), None)


SECRETS = {
    "environment": "'WANDB_API_KEY' in __import__('os').environ",
    "credentials-file": "__import__('pathlib').Path(__import__('os').environ['HOSTILE_SECRET_FILE']).exists()"
    " and 'wandb' in open(__import__('os').environ['HOSTILE_SECRET_FILE']).read()",
    "parents-environ": "b'wandb-secret' in open(f'/proc/{__import__(\"os\").getppid()}/environ', 'rb').read()",
    "any-process-environ": "any(b'wandb-secret' in open(f'/proc/{p}/environ', 'rb').read() for p in "
    "__import__('os').listdir('/proc') if p.isdigit())",
}


@pytest.mark.parametrize("reads", SECRETS.values(), ids=SECRETS.keys())
def test_code_that_reads_a_secret_finds_none(reads, isolation, secrets_in_the_environment):
    """It solves the task only if it read the secret; it scores what a wrong answer scores."""
    guarded = f"try:\n    READ = bool({reads})\nexcept Exception:\n    READ = False\n"
    assert score(guarded + solves_if("READ"), isolation) == (pytest.approx(1 / 3), None)


@pytest.mark.serial  # looks for `sleep 600` anywhere on the machine
def test_code_cannot_kill_write_plant_or_leave_a_process(isolation, bystander, tmp_path):
    """It tries to kill a process of the worker's user, to write into the installed package and the worker's
    working directory, and to start processes that outlive it (also in a session of their own)."""
    import grpo_dist

    install = Path(grpo_dist.__file__).parent / "planted_by_the_model.py"
    planted = Path.cwd() / "json.py"
    attack = (
        "import os, signal, subprocess\n"
        f"for pid in ({bystander.pid}, -1):\n    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n"
        "        pass\n"
        f"for path in ({str(install)!r}, {str(planted)!r}):\n    try:\n        open(path, 'w').write('x = 1')\n"
        "    except OSError:\n        pass\n"
        "for argv in (['sleep', '600'], ['setsid', 'sleep', '600']):\n    try:\n"
        "        subprocess.Popen(argv, start_new_session=True)\n    except OSError:\n        pass\n"
    )
    assert score(attack + solves_if("True"), isolation)[0] == 1.0  # the attack ran to its end
    assert bystander.poll() is None
    assert not install.exists() and not planted.exists()
    assert not [p for p in psutil.process_iter(["name", "cmdline"]) if p.info["cmdline"] == ["sleep", "600"]
                and p.pid != bystander.pid]  # fmt: skip


def test_a_runaway_is_killed_and_unscored_tests_do_not_wait_on_it(isolation):
    """An endless loop and a memory grab fail their tests within the bound; the call itself is scored."""
    assert score("while True:\n    pass\n", isolation, tests=TESTS[:1], timeout_per_test_s=1.0) == (0.0, None)
    assert score("x = bytearray(8 << 30)\n" + solves_if("True"), isolation) == (0.0, None)
    # 2 GiB is within the reward sandbox's 4 GiB (reward.sandbox_memory_mb) but past a jail's 1 GiB
    assert score("x = bytearray(2 << 30)\n" + solves_if("True"), isolation) == (0.0, None)


def test_slow_code_scores_what_it_solved_in_time_never_unscored(isolation):
    """A completion that sleeps past the reward's bound is not unscored (which would spare it a low advantage): the
    tests it did not reach fail."""
    assert score("import time\ntime.sleep(100)\n" + solves_if("True"), isolation, timeout_s=3.0) == (0.0, None)


def test_code_that_stops_reading_cannot_hang_the_worker(isolation):
    """It shrinks its input pipe to one page, says it ran, and never reads the (long) test: the test fails in its
    bound, the call returns."""
    stall = ("import fcntl, os, sys, time\nfcntl.fcntl(0, 1031, 4096)\nos.write(int(sys.argv[1]), b'ran\\n')\n"
             "time.sleep(3600)\n")  # fmt: skip
    long_test = "assert add(1, 2) == 3  # " + "x" * 70_000
    assert score(stall + solves_if("True"), isolation, tests=[long_test], timeout_per_test_s=1.0) == (0.0, None)


def test_code_cannot_fill_the_disk_or_reach_the_callers_keyring(isolation):
    """It writes 200 MB to its temporary directory and /dev/shm, and searches the session keyring for a key the
    worker holds: it solves the task only where either worked."""
    key = keyring_key(SECRET)
    fills = (
        "import ctypes, os\nFILLED = False\nfor path in ('/tmp/fill', '/dev/shm/fill', 'fill'):\n    try:\n"
        "        with open(path, 'wb') as file:\n            for _ in range(200):\n"
        "                file.write(b'x' * (1 << 20))\n        FILLED = True\n    except OSError:\n        pass\n"
        f"found = ctypes.CDLL(None).syscall({KEYCTL_SEARCH[0]}, 10, -3, b'user', b'grpo-hostile', 0)\n"
    )
    assert score(fills + solves_if("not FILLED and found == -1"), isolation) == (1.0, None)
    assert score(fills + solves_if("FILLED or found != -1"), isolation) == (pytest.approx(1 / 3), None)
    assert key > 0  # the key was there to find


KEYCTL_SEARCH = {"x86_64": (250, 248), "aarch64": (219, 217)}.get(__import__("platform").machine(), (250, 248))


def keyring_key(payload: str) -> int:
    """A key in this process's session keyring (a fresh one), as a worker could hold a credential there."""
    libc = ctypes.CDLL(None, use_errno=True)
    keyctl, add_key = KEYCTL_SEARCH
    libc.syscall(keyctl, 1, None)  # KEYCTL_JOIN_SESSION_KEYRING: a new anonymous session keyring
    data = payload.encode()
    return libc.syscall(add_key, b"user", b"grpo-hostile", data, len(data), -3)  # KEY_SPEC_SESSION_KEYRING


def test_a_row_without_tests_leaves_its_completion_unscored_saying_why(isolation):
    """The row's fault, not the completion's: `unscorable`, which no floor replaces."""
    total, error = score(solves_if("True"), isolation, tests=[])
    assert math.isnan(total) and "holds no test" in error.reason and error.kind == "unscorable"


def test_require_stops_a_run_before_anything_starts_where_namespaces_are_refused(tmp_path, capfd):
    """`grpo-dist train` with `code_tests` on a machine that refuses namespaces: exit 2, one line saying what was
    refused and what to do, before Ray or an engine starts; `best_effort` lets the same config through the
    pre-flight, saying what isolation is in force. (`check`, in this process: what isolation is in force is probed
    once a process, so the probe is forgotten before and after.)"""
    fake = tmp_path / "bin" / "bwrap"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nprintf '{REFUSED}' >&2\nexit 1\n")
    fake.chmod(0o755)
    raw = small_config(tmp_path, reward={"functions": [{"name": "code_tests", "kwargs": {"tests": TESTS}}]})
    import yaml

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    env = {"PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    jail.status.cache_clear()
    try:
        done = cli_here(capfd, "check", str(config), env=env)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "reward.isolation=require" in done.stderr and "bwrap: No permissions" in done.stderr
        assert "securityContext.seccompProfile" in done.stderr
        allowed = cli_here(capfd, "check", str(config), "reward.isolation=best_effort", env=env)
        assert allowed.returncode == 0, allowed.stdout + allowed.stderr
        assert "runs WITHOUT namespaces (bubblewrap was refused" in allowed.stdout
    finally:
        jail.status.cache_clear()  # this machine's own, probed again by the next test


# The python tool: the model's code as a tool call, run by the generator's ToolBox.


def run_tool(code: str, isolation: str, timeout_s: float = 5.0) -> ToolCall:
    limits = SandboxLimits(1024, timeout_s, False, False, isolation == "require")
    box = ToolBox([tool_spec("python")], limits, workers=1, timeout_s=timeout_s)
    call = ToolCall(name="python", arguments={"code": code})
    try:
        import asyncio

        asyncio.run(box.run([call]))
    finally:
        box.close()
    return call


def test_code_run_as_its_callers_own_user_finds_the_callers_environment_closed():
    """Best effort under a user other than root runs the code as that same user: the process that starts it makes
    itself undumpable first (`Jailed` does), so the code cannot read its environment, the run's tokens. Here a
    forked process of another user plays the caller, its child the code."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to become another user")
    assert "as the user nobody" in jail.Status(False, "refused").describe()
    read_end, write_end = os.pipe()
    caller = os.fork()
    if caller == 0:
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            ctypes.CDLL(None).prctl(privileges.PR_SET_DUMPABLE, 1, 0, 0, 0)  # as an ordinary process of its user is
            said = b""
            for hidden in (False, True):
                if hidden:
                    privileges.hide_from_own_user()
                code = os.fork()
                if code == 0:
                    try:
                        with open(f"/proc/{os.getppid()}/environ", "rb") as environ:
                            os._exit(0 if environ.read() else 1)  # what the process started with: its tokens
                    except PermissionError:
                        os._exit(13)
                _, status = os.waitpid(code, 0)
                said += b"%d " % os.waitstatus_to_exitcode(status)
            os.write(write_end, said)
        finally:
            os._exit(0)
    os.close(write_end)
    said = os.read(read_end, 100).decode().split()
    os.waitpid(caller, 0)
    os.close(read_end)
    assert said == ["0", "13"]  # the environment read before, closed after


def test_the_python_tool_runs_the_models_code_and_reaches_nothing_else(isolation, bystander):
    assert run_tool("print(6 * 7)", isolation).result.strip() == "42"
    assert "ZeroDivisionError" in run_tool("1 / 0", isolation).result  # the model reads its traceback
    reads = (
        "import os\nprint(os.environ.get('WANDB_API_KEY'), end=' ')\n"
        f"try:\n    os.kill({bystander.pid}, 9)\nexcept OSError as error:\n    print(type(error).__name__)\n"
    )
    said = run_tool(reads, isolation).result
    assert SECRET not in said and said.split() == ["None", "ProcessLookupError" if isolation == "require"
                                                   else "PermissionError"]  # fmt: skip
    assert bystander.poll() is None
    assert "stopped: ran past 1s" in run_tool("while True:\n    pass\n", isolation, timeout_s=1.0).result
    flooded = run_tool("import time\nprint('é' * 100_000, flush=True)\ntime.sleep(30)\n", isolation).result
    assert flooded.endswith("[output cut]") and "ran past" not in flooded  # counted in bytes, not characters


# User reward functions in the sandbox: values and answers out of protocol, secrets, planted modules.


@pytest.mark.parametrize(
    "name, kind, said",
    [
        ("nan_reward", "raised", "expected a finite number"),
        ("inf_reward", "raised", "expected a finite number"),
        ("float32_overflow_reward", "raised", "beyond ±1e+30"),
        ("huge_int_reward", "raised", "OverflowError"),
        ("string_reward", "raised", "expected a float"),
        ("forging_reward", "crashed", "out of protocol"),
        ("garbage_reward", "crashed", "out of protocol (not JSON"),
        ("blaming_reward", "crashed", "out of protocol (no failure of kind 'sandbox_died' comes from a call)"),
        ("setup_failing_reward", "crashed", "exited with code 70"),
    ],
)
def test_a_reward_answer_out_of_protocol_fails_only_its_own_call(name, kind, said):
    """A value that is no score is the call's failure (`raised`: the reward worker gives it the floor); so is an
    answer out of protocol from the call's process (`crashed`): the server, which no call's code ran in, checks it."""
    runner = runner_of([f"reward_fixtures.{name}", "reward_fixtures.length_reward"])
    try:
        total, _, errors = runner.score([0], [1.0], [{}], "q", "abc", {})
        assert math.isnan(total) and said in errors[0].reason and errors[0].kind == kind, errors
        for completion in ("abcd", "abcde"):  # every later call answered by its own function, nothing left over
            assert runner.score([1], [1.0], [{}], "q", completion, {}) == (len(completion), [len(completion)], [None])
    finally:
        runner.close()
    assert sandboxed_processes() == []


@pytest.mark.parametrize("sandbox", [True, False], ids=["sandbox", "threads"])
def test_rewards_whose_sum_overflows_leave_the_completion_unscored(sandbox):
    """6e29 twice passes rewards.REWARD_LIMIT (1e30), and 6e299 twice float64's range: unscored, never raised."""
    runner = runner_of(["reward_fixtures.big_reward", "reward_fixtures.big_reward"], sandbox=sandbox)
    try:
        total, scores, errors = runner.score([0, 1], [1.0, 1.0], [{}, {}], "q", "abc", {})
        assert scores == [6e29, 6e29] and errors == [None, None] and math.isnan(total)
        assert math.isnan(runner.score([0, 1], [1e270, 1e270], [{}, {}], "q", "abc", {})[0])
    finally:
        runner.close()


def test_the_sandbox_gets_no_secret_unless_named():
    for passed, expected in (([], 0.0), (["WANDB_API_KEY"], 1.0)):
        runner = runner_of(["reward_fixtures.secret_reward"], sandbox_env=passed)
        try:
            assert runner.score([0], [1.0], [{}], "q", "abc", {})[0] == expected
        finally:
            runner.close()


@pytest.fixture
def open_directory():
    """A directory anyone may write, where `nobody` reaches it (pytest's own are under a directory only root reads)."""
    made = Path(tempfile.mkdtemp(prefix="grpo-open-"))
    made.chmod(0o777)
    yield made
    shutil.rmtree(made, ignore_errors=True)


def test_code_planted_where_a_reward_writes_never_runs_as_root(isolation, open_directory, monkeypatch):
    """The worker's working directory is writable by anyone (the worst case): a reward plants a module, a
    `sitecustomize` and a package `grpo_dist` in every directory of its import path, its home, its temporary and
    working directories it can write. In namespaces it can write none of the machine's (the sandbox's are its own
    and emptied after the call); without, what it planted in the working directory is imported by the next sandbox
    only as `nobody`, after the installed modules. The planted code, run, leaves a mark naming its user."""
    if os.geteuid() != 0:
        pytest.skip("the change of user happens under root")
    tmp_path = open_directory
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    runner = runner_of(["reward_fixtures.planting_reward", "reward_fixtures.length_reward"], isolation=isolation)
    try:
        assert runner.score([0], [1.0], [{"module": "planted_probe"}], "q", "abc", {})[0] == 1.0
        assert runner.score([1], [1.0], [{}], "q", "abcd", {})[0] == 4.0  # the next call in the same sandbox
    finally:
        runner.close()
    planted = (tmp_path / "planted_probe.py").exists()
    assert planted == (isolation == "best_effort")
    try:
        probe = runner_of(["planted_probe.probe"], isolation=isolation)
    except Exception as error:
        assert isolation == "require" and "planted_probe" in str(error)  # nothing planted to import
    else:
        try:
            assert probe.score([0], [1.0], [{}], "q", "abc", {})[0] == float(NOBODY)
        finally:
            probe.close()
    marks = [*tmp_path.glob("planted-ran-as-*"), *Path(tempfile.gettempdir()).glob("planted-ran-as-*")]
    assert "planted-ran-as-0" not in {mark.name for mark in marks}, marks
    for mark in Path(tempfile.gettempdir()).glob("planted-ran-as-*"):
        mark.unlink()


def test_nothing_a_call_does_outlives_it(isolation):
    """A call patches its module (a flag, its own function, another reward's), a builtin, and starts a thread: the
    next calls, in the same sandbox, score as if it never ran."""
    runner = runner_of(["reward_fixtures.patching_reward", "reward_fixtures.length_reward"], isolation=isolation)
    try:
        for completion in ("abc", "abcd"):
            assert runner.score([0], [1.0], [{}], "q", completion, {})[0] == len(completion)
        assert runner.score([1], [1.0], [{}], "q", "abcde", {})[0] == 5.0
    finally:
        runner.close()


def test_a_reward_reads_no_root_file_no_other_sandbox_and_in_namespaces_no_ray_session(isolation):
    """A file only root reads, another sandbox's home; in namespaces also the Ray session directory and any entry
    of the machine's `/tmp` (`best_effort` shares the machine's `/tmp`, where other homes cannot be listed)."""
    if os.geteuid() != 0:
        pytest.skip("a file only root reads")
    secret = Path("/root/secret-grpo-sandbox-test")
    secret.write_text(SECRET)
    secret.chmod(0o600)
    made_ray = not os.path.exists("/tmp/ray")
    os.makedirs("/tmp/ray/session_latest", exist_ok=True)
    other = runner_of(["reward_fixtures.length_reward"], isolation=isolation)
    try:
        paths = [str(secret), other.sandbox.home] + (["/tmp/ray", "/tmp/ray/session_latest"] if isolation == "require"
                                                      else [])  # fmt: skip
        runner = runner_of(["reward_fixtures.seeing_reward"], isolation=isolation)
        try:
            seen = runner.score([0], [1.0], [{"paths": paths}], "q", "abc", {})[0]
        finally:
            runner.close()
        assert seen % 100 == 0 and (isolation == "best_effort" or seen == 0), seen
    finally:
        other.close()
        secret.unlink()
        if made_ray:
            shutil.rmtree("/tmp/ray")


@pytest.mark.serial  # looks for `sleep 600` anywhere on the machine
def test_a_process_a_reward_detaches_dies_with_the_sandbox():
    runner = runner_of(["reward_fixtures.detaching_reward"], sandbox_processes=True)
    try:
        assert runner.score([0], [1.0], [{}], "q", "abc", {})[0] == 1.0
    finally:
        runner.close()
    assert sandboxed_processes() == []
    leftover = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "600"]]
    for process in leftover:
        process.send_signal(signal.SIGKILL)
    assert leftover == []


@pytest.mark.serial  # looks for `sleep 600` anywhere on the machine
def test_what_a_reward_starts_dies_with_a_worker_killed_without_closing_its_sandbox(tmp_path):
    """A reward worker SIGKILLed at the end of a run closes nothing: what its reward started in a session of its own
    dies all the same (the sandbox is the first process of a PID namespace of its own, killed with the worker)."""
    script = (
        "import sys, time\nsys.path.insert(0, 'tests')\nfrom test_sandbox import runner_of\n"
        "runner = runner_of(['reward_fixtures.detaching_reward'], sandbox_processes=True)\n"
        "print(runner.score([0], [1.0], [{}], 'q', 'abc', {})[0], flush=True)\ntime.sleep(600)\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "1.0"
        deadline = time.monotonic() + 10
        while not sleepers() and time.monotonic() < deadline:  # its exec may still be on its way
            time.sleep(0.05)
        assert sleepers(), "the reward started nothing"
    finally:
        worker.kill()
        worker.wait()
    deadline = time.monotonic() + 10
    while sleepers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sleepers() == []


def sleepers() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[-2:] == ["sleep", "600"]]


def test_the_scratch_directories_of_killed_workers_are_removed_by_the_next_process(tmp_path):
    """A worker killed at the end of a run leaves its sandboxes' homes behind; the next process that makes one of
    its own removes those of processes that are gone, and keeps those of live ones."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = Path(tempfile.gettempdir()) / f"grpo-rewards-sandbox-pid{dead.pid}-left"
    kept = Path(tempfile.gettempdir()) / f"grpo-rewards-sandbox-pid{os.getpid()}-kept"
    for path in (left, kept):
        path.mkdir()
        (path / "file").write_text("x")
    script = "from grpo_dist.sandbox import jail; import shutil; shutil.rmtree(jail.scratch_dir('probe'))"
    try:
        subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
        assert not left.exists() and kept.exists()
    finally:
        shutil.rmtree(left, ignore_errors=True)
        shutil.rmtree(kept, ignore_errors=True)
