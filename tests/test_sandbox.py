"""User reward code in the sandbox: each way reward code misbehaves (starting processes or threads, never returning,
asking for far too much memory, using the network, ending its process) fails only its own completion, saying why and
counted by kind: what the call did itself (timeout, memory, crashed) scores the floor, what was refused by a setting
or done from outside leaves the completion unscored; the sandbox is back for the next call; nothing it started
outlives it. A real run with such a
reward goes on to its end and leaves no process behind. The bundled `code_tests` reward runs the model's code jailed
(`test_hostile.py` attacks it)."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading

import psutil
import pytest
from conftest import small_config
from test_resume import training

from grpo_dist.config import RewardConfig, RewardFunctionConfig
from grpo_dist.rewards.runner import RewardRunner
from grpo_dist.sandbox import SANDBOX_MARK, ended_kind, exit_reason, privileges
from grpo_dist.types import ScoreRequest

FIXTURES = "reward_fixtures"


def sandboxed_processes(owner: int | None = -1) -> list[psutil.Process]:
    """Every process on this machine that carries the sandbox mark of `owner` (a sandbox, or anything one started):
    by default this process's, None: anyone's."""
    owner = os.getpid() if owner == -1 else owner
    found = []
    for process in psutil.process_iter():
        try:
            mark = process.environ().get(SANDBOX_MARK)
        except psutil.Error:
            continue
        if mark is not None and (owner is None or mark == str(owner)):
            found.append(process)
    return found


@pytest.fixture
def server():
    """A local TCP server: a reward with the network would reach it."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        listening.settimeout(0.2)
        yield listening


@pytest.fixture(autouse=True, scope="module")
def reaping_only_here():
    """The runners below make this process a subreaper, as a reward worker is; it must not stay one for the tests
    that follow: a process they orphan (a Ray daemon's child, a job's driver) would be re-parented here and, never
    reaped, stay a zombie that Ray's job supervisor waits on."""
    yield
    if sys.platform.startswith("linux"):
        privileges.reap_orphans_here(False)


def runner_of(names: list[str], **reward) -> RewardRunner:
    """A runner as a reward worker has one (this process re-parents what leaves the sandbox's group)."""
    functions = [RewardFunctionConfig(name=name) for name in names]
    return RewardRunner(names, RewardConfig(functions=functions, **{"timeout_s": 2.0, **reward}), reap=True)


def test_a_sandbox_started_without_waiting_says_its_import_failure_when_waited_for():
    """The pre-flight's sandbox imports the functions while the driver loads the tokenizer and the data
    (`wait=False`): the runner comes back at once, and `ready` raises what the start would have."""
    from grpo_dist.sandbox import SandboxError

    functions = [RewardFunctionConfig(name="no_such_pkg.mod.fn")]
    with pytest.raises(SandboxError, match="cannot import module 'no_such_pkg.mod'"):
        RewardRunner(["no_such_pkg.mod.fn"], RewardConfig(functions=functions))
    runner = RewardRunner(["no_such_pkg.mod.fn"], RewardConfig(functions=functions), wait=False)
    try:
        assert runner.sandbox.starting is not None  # started, its ready line not read
        with pytest.raises(SandboxError, match="cannot import module 'no_such_pkg.mod'"):
            runner.ready()
    finally:
        runner.close()


def test_a_workers_sandbox_warms_math_answer_up_as_it_starts_and_the_preflights_at_its_first_call_that_needs_it():
    """A reward worker's sandbox imports math-verify and sympy before its first call, which its time limit bounds;
    the pre-flight's (`warm_builtins=False`) leaves them to the first call that needs them (an answer that is not a
    plain integer), which still scores as math-verify does. A reward's call forked from the server sees what it has
    imported."""
    names = ["math_answer", "reward_fixtures.sympy_imported"]
    worker = runner_of(names)
    functions = [RewardFunctionConfig(name=name) for name in names]
    preflight = RewardRunner(names, RewardConfig(functions=functions, timeout_s=60.0), warm_builtins=False)

    def score(runner: RewardRunner, function: int, completion: str, answer: str) -> float:
        return runner.score([function], [1.0], [{}], "q", completion, {"answer": answer})[1][0]

    try:
        assert score(worker, 1, "7", "7") == 1.0
        assert score(preflight, 1, "7", "7") == 0.0
        assert score(preflight, 0, "7", "7") == 1.0  # two plain integers: compared without sympy
        assert score(preflight, 1, "7", "7") == 0.0
        assert score(preflight, 0, "1/2", "\\frac{1}{2}") == 1.0
        assert score(preflight, 0, "1/3", "\\frac{1}{2}") == 0.0
        assert score(preflight, 1, "7", "7") == 1.0
    finally:
        worker.close()
        preflight.close()


def test_the_preflights_sandbox_still_says_a_user_functions_warm_up_that_raises():
    """Only the built-ins' warm-ups wait for their first call in the pre-flight: a user's that raises stops it."""
    from grpo_dist.sandbox import SandboxError

    names = ["math_answer", "reward_fixtures.warm_up_failing_reward"]
    functions = [RewardFunctionConfig(name=name) for name in names]
    with pytest.raises(SandboxError, match="warm_up_failing_reward's sandbox_warmup raised RuntimeError"):
        RewardRunner(names, RewardConfig(functions=functions, timeout_s=60.0), warm_builtins=False)


@pytest.mark.parametrize(
    "name, kind, said",
    [
        ("forking_reward", "processes", "BlockingIOError"),
        ("threading_reward", "processes", "can't start new thread"),
        ("sleeping_reward", "timeout", "timed out after 2s (the reward sandbox was killed"),
        ("hungry_reward", "memory", "MemoryError (the sandbox limits its memory to 1024 MB"),
        ("networking_reward", "network", "(the sandbox allows no network"),  # refused or unreachable: no route out
        ("quitting_reward", "crashed", "the reward sandbox exited with code 3"),
        ("crashing_reward", "crashed", "the reward sandbox was crashed (SIGSEGV)"),
        ("unscorable_reward", "unscorable", "Unscorable: the row has no `answer`"),
    ],
)
def test_a_misbehaving_reward_fails_its_completion_saying_why_and_the_next_call_is_scored(name, kind, said, server):
    runner = runner_of([f"{FIXTURES}.{name}", f"{FIXTURES}.length_reward"], sandbox_memory_mb=1024)
    try:
        port = server.getsockname()[1]
        total, scores, errors = runner.score([0], [1.0], [{"port": port}], "q", "abc", {})
        assert math.isnan(total) and math.isnan(scores[0])
        assert said in errors[0].reason and errors[0].kind == kind, errors[0]
        assert runner.score([1], [1.0], [{}], "q", "abcd", {})[0] == 4.0  # the sandbox serves on (or anew)
        with pytest.raises(TimeoutError):
            server.accept()  # nothing reached the network
    finally:
        runner.close()
    assert sandboxed_processes() == []


def test_a_sandbox_killed_from_outside_leaves_its_completion_unscored_and_serves_on():
    """SIGKILL from outside (or the out-of-memory killer) is the machine's doing, not the call's: `sandbox_died`."""
    runner = runner_of([f"{FIXTURES}.sleeping_reward", f"{FIXTURES}.length_reward"], timeout_s=20.0)
    killer = threading.Timer(1.0, os.kill, (runner.sandbox.process.pid, signal.SIGKILL))
    try:
        killer.start()
        total, _, [failure] = runner.score([0], [1.0], [{}], "q", "abc", {})
        assert math.isnan(total) and failure.kind == "sandbox_died" and "SIGKILL" in failure.reason, failure
        assert runner.score([1], [1.0], [{}], "q", "abcd", {})[0] == 4.0
    finally:
        killer.cancel()
        runner.close()


def test_calls_of_the_built_ins_asked_ahead_are_answered_in_order_and_a_sandbox_killed_among_them_loses_one():
    """A reward worker's calls of the built-ins go to the sandbox ahead of their answers (`Sandbox.answers`): each
    completion gets the score it gets alone, in order. The sandbox killed from outside while calls are waiting loses
    the call it was on, left unscored (`sandbox_died`); the calls asked after it are asked of a new sandbox and
    scored."""
    runner = runner_of(["regex_format", "math_answer"])
    functions, weights, kwargs = [0, 1], [0.2, 0.8], [{"pattern": "[0-9]"}, {}]
    completions = [("7 3 9 5:", completion, {"answer": "5"}) for completion in ["5", "3", " 5", "55", "", "5 "] * 100]
    try:
        alone = [runner.score(functions, weights, kwargs, *each) for each in completions]
        assert sorted({round(total, 6) for total, _, _ in alone}) == [0.0, 0.2, 1.0]
        first = runner.sandbox.process.pid
        together = []
        for total, scores, errors in runner.score_each(functions, weights, kwargs, completions):
            together.append((total, scores, errors))
            if len(together) == 100:
                os.kill(first, signal.SIGKILL)  # 32 calls are waiting at most: the sandbox is on one of them
        lost = [index for index, (_, _, errors) in enumerate(together) if any(errors)]
        assert len(lost) == 1 and lost[0] >= 100, lost
        [failure] = [error for error in together[lost[0]][2] if error is not None]
        assert failure.kind == "sandbox_died" and "SIGKILL" in failure.reason, failure
        assert [each for index, each in enumerate(together) if index != lost[0]] == alone[: lost[0]] + alone[
            lost[0] + 1 :
        ]
        assert runner.sandbox.process.pid != first
    finally:
        runner.close()


def test_where_a_call_runs_in_the_worker_a_completions_sandbox_calls_run_before_it_none_asked_ahead():
    """With a built-in the worker runs itself (`code_tests`, jailed from here), a completion's calls in the sandbox are
    answered before it runs: a call asked ahead would run while the worker does, its bound (`reward.timeout_s` from
    the answer before) not counting that time. The sandbox's call returns when it ran (a user function taken for a
    built-in, so that it would be asked ahead as one); the jailed call is a stand-in that notes when it ended."""
    import time

    runner = runner_of([f"{FIXTURES}.clock_reward", "code_tests"], isolation="best_effort")
    runner.sandbox.in_server[0] = True  # asked as a built-in's call is
    ended = []

    def stand_in(prompt: str, completion: str, **_) -> float:
        time.sleep(0.3)
        ended.append(time.monotonic())
        return 1.0

    runner.jailed[1] = stand_in
    completions = [("q", str(number), {}) for number in range(4)]
    try:
        scored = list(runner.score_each([0, 1], [0.0, 1.0], [{}, {}], completions))
    finally:
        runner.close()
    assert all(errors == [None, None] for _, _, errors in scored), scored
    ran = [scores[0] for _, scores, _ in scored]
    assert len(ended) == 4 and all(ran[number + 1] > ended[number] for number in range(3)), (ran, ended)


def test_a_user_functions_call_is_asked_alone_so_its_process_holds_no_other_completion():
    """A call of a user function runs in a process forked from the server: the built-ins' calls around it are not
    asked ahead of its answer, so that process never holds a request the server was sent after its own. The same
    calls asked ahead (the function taken for a built-in) show that it would."""
    from grpo_dist.sandbox import Limits, Sandbox

    names = ["regex_format", f"{FIXTURES}.sees_other_requests"]
    calls = [(index, "q", f"answer {number}", {"pattern": "[0-9]"} if index == 0 else {})
             for number in range(8) for index in (0, 1, 1)]  # fmt: skip
    limits = Limits(memory_mb=4096, cpu_s=10.0, processes=False, network=False)
    seen = {}
    for in_server in ([True, False], [True, True]):
        sandbox = Sandbox(names, limits, in_server=in_server)
        try:
            answers = list(sandbox.answers(calls, 10.0))
        finally:
            sandbox.close()
        assert all(failure is None for _, failure in answers), answers
        seen[in_server[1]] = [score for (index, *_), (score, _) in zip(calls, answers, strict=True) if index == 1]
    assert seen[False] == [0.0] * 16
    assert max(seen[True]) == 1.0, seen[True]


@pytest.mark.parametrize(
    "code, kind",
    [(-signal.SIGXCPU, "timeout"), (-signal.SIGSEGV, "crashed"), (128 + signal.SIGABRT, "crashed"), (3, "crashed"),
     (-signal.SIGKILL, "sandbox_died"), (128 + signal.SIGTERM, "sandbox_died"), (None, "sandbox_died")],
    ids=["cpu_time", "segfault", "abort_under_bwrap", "exit", "sigkill", "sigterm_under_bwrap", "no_status"],
)  # fmt: skip
def test_how_a_sandbox_ended_in_a_call_tells_whose_failure_it_was(code, kind):
    assert ended_kind(code) == kind


@pytest.mark.parametrize("on_failure", ["floor", "unscored"])
def test_a_reward_that_crashes_its_sandbox_scores_the_floor_in_a_worker(on_failure):
    """The reward worker gives the crashing function its floor (0) under the default, adding the other's score."""
    from grpo_dist.cluster.actors.reward_worker import RewardWorker

    names = [f"{FIXTURES}.crashing_reward", f"{FIXTURES}.length_reward"]
    functions = [RewardFunctionConfig(name=name) for name in names]
    worker = RewardWorker(RewardConfig(functions=functions, timeout_s=5.0, on_failure=on_failure), judges=[])
    try:
        [score], _, _ = worker.score([ScoreRequest("q", "abc", {})])
    finally:
        worker.close()
    assert score.failures[names[0]].kind == "crashed"
    if on_failure == "floor":
        assert (score.total, score.per_function) == (3.0, [0.0, 3.0])
    else:
        assert math.isnan(score.total) and math.isnan(score.per_function[0])
    assert sandboxed_processes() == []


def test_with_processes_allowed_what_a_reward_starts_dies_with_its_call():
    """A call's process and what it started in its process group are killed when it answers (what leaves the group
    dies with the sandbox: `test_hostile.test_a_process_a_reward_detaches_dies_with_the_sandbox`)."""
    runner = runner_of([f"{FIXTURES}.forking_reward"], sandbox_processes=True)
    try:
        assert runner.score([0], [1.0], [{}], "q", "abc", {})[0] == 1.0
        assert [p for p in sandboxed_processes() if p.name() == "sleep"] == []  # `sleep 600`, which it left running
    finally:
        runner.close()
    assert sandboxed_processes() == []


def test_rewards_run_in_this_process_only_when_the_sandbox_is_off():
    inside = runner_of([f"{FIXTURES}.forking_reward"], sandbox=False)  # the process limit is the sandbox's
    try:
        assert inside.score([0], [1.0], [{}], "q", "abc", {})[0] == 1.0
    finally:
        inside.close()
    for process in psutil.Process().children():
        if process.name() == "sleep":
            process.kill()


SOLVED = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]


@pytest.mark.parametrize(
    "completion, score",
    [
        (SOLVED, 1.0),
        ("```python\ndef add(a, b):\n    return a + b if a > 0 else 7\n```", 0.5),  # passes one test of two
        ("```python\ndef add(a, b)\n    return a + b\n```", 0.0),  # does not parse
        ("```python\ndef add(a, b):\n    while True:\n        pass\n```", 0.0),  # never returns: each test times out
        ("```python\nimport os\nos.fork()\ndef add(a, b):\n    return a + b\n```", 0.0),  # refused a process
        ("```python\nx = bytearray(64 << 30)\ndef add(a, b):\n    return a + b\n```", 0.0),  # refused the memory
    ],
    ids=["solved", "half", "syntax-error", "endless-loop", "fork", "memory"],
)
def test_code_tests_scores_the_fraction_of_tests_the_models_code_passes(completion, score):
    runner = runner_of(["code_tests"], timeout_s=10.0)
    try:
        kwargs = {"timeout_per_test_s": 0.5}
        fields = {"tests": TESTS, "difficulty": "easy"}  # a field it does not read is ignored
        total, _, errors = runner.score([0], [1.0], [kwargs], "Write add(a, b).", completion, fields)
        assert (total, errors) == (score, [None])
    finally:
        runner.close()


def test_code_tests_runs_the_models_code_jailed_with_the_sandbox_off_too(monkeypatch):
    """`reward.sandbox: false` runs user rewards in the worker's threads; the model's code is jailed all the same."""
    monkeypatch.setenv("WANDB_API_KEY", "a-token")
    runner = runner_of(["code_tests"], sandbox=False, timeout_s=10.0)
    completion = "import os\ndef add(a, b):\n    return a + b if 'WANDB_API_KEY' in os.environ else 0\n"
    try:  # add(-1, 1) == 0 passes either way; add(1, 2) == 3 only with the token
        assert runner.score([0], [1.0], [{}], "add", completion, {"tests": TESTS}) == (0.5, [0.5], [None])
    finally:
        runner.close()


@pytest.mark.slow
@pytest.mark.serial  # looks for `sleep 600`, sandboxes and bubblewrap anywhere on the machine
def test_a_run_with_a_misbehaving_reward_goes_on_and_leaves_no_process(tmp_path, server):
    """One reward misbehaves each way once, across both reward workers; every other completion is scored."""
    claims = tmp_path / "claims"
    claims.mkdir(mode=0o777)
    claims.chmod(0o777)  # the sandbox runs as `nobody` under root
    misbehaving = {
        "name": f"{FIXTURES}.misbehaving_reward",
        "weight": 1.0,
        "kwargs": {"state_dir": str(claims), "port": server.getsockname()[1]},
    }
    raw = small_config(tmp_path, run={"steps": 3})
    model_code = {"name": "code_tests", "weight": 0.0, "kwargs": {"tests": ["assert len(str(x)) >= 0"] * 2}}
    raw["reward"].update(functions=[misbehaving, model_code], timeout_s=3, sandbox_memory_mb=1024,
                         sandbox_paths=[str(claims)])  # fmt: skip
    jails_before = set(bwrap_pids())  # other tests' actors, idle in a shared cluster, may hold some
    with training(tmp_path, raw) as run:
        assert run.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "outputs" / "test" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    why = {kind: sum(row[f"reward_failures/why/{kind}"] for row in rows)
           for kind in ("processes", "timeout", "memory", "network", "crashed", "sandbox_died", "raised")}  # fmt: skip
    assert why == {"processes": 2, "timeout": 1, "memory": 1, "network": 1, "crashed": 1, "sandbox_died": 0,
                   "raised": 0}  # fmt: skip
    # The call's own failures (timeout, memory, its os._exit) scored the floor; refused settings left it unscored.
    assert sum(row["reward_failures/floored"] for row in rows) == 3 and sum(row["reward/unscored"] for row in rows) == 3
    assert [row["sandbox/namespaces"] for row in rows] == [1.0, 1.0, 1.0]  # the model's code ran jailed
    assert [row["reward_failures/code_tests"] for row in rows] == [0.0, 0.0, 0.0]
    assert sorted(os.listdir(claims)) == [str(index) for index in range(6)]
    with pytest.raises(TimeoutError):
        server.accept()
    assert sandboxed_processes(owner=None) == []
    assert subprocess.run(["pgrep", "-f", "sleep 600"], capture_output=True).stdout == b""
    assert set(bwrap_pids()) <= jails_before  # the run's jails and sandboxes went with it


def bwrap_pids() -> list[int]:
    """The bubblewrap processes alive (not those dead and left unreaped: this process is a subreaper, see
    `sandbox`, so the run's orphans that died end here as zombies)."""
    living = psutil.process_iter(["name", "status"])
    return [process.pid for process in living
            if process.info["name"] == "bwrap" and process.info["status"] != psutil.STATUS_ZOMBIE]  # fmt: skip


@pytest.mark.parametrize(
    "code, said",
    [(3, "exited with code 3"), (-9, "killed (SIGKILL"), (137, "killed (SIGKILL"), (139, "crashed (SIGSEGV)")],
    ids=["exit", "signal", "signal-through-bubblewrap", "crash-through-bubblewrap"],
)
def test_an_ended_sandbox_is_named_by_how_it_ended_also_through_bubblewrap(code, said):
    """Bubblewrap, which runs the sandbox in a PID namespace of its own, reports a signal as 128 + its number."""
    assert said in exit_reason(code)


def test_a_sandbox_path_that_is_not_there_is_named_before_the_sandbox_starts(tmp_path):
    from grpo_dist.sandbox import Limits, Sandbox, SandboxError

    with pytest.raises(SandboxError, match=f"reward.sandbox_paths: no directory {tmp_path / 'gone'} on this node"):
        Sandbox(["regex_format"], Limits(1024, 5.0, False, False, paths=(str(tmp_path / "gone"),)))
