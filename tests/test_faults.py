"""Faults survived with the real stack: while `grpo-dist train` runs, its actor processes, or a generator's vLLM
engine process, are killed (SIGKILL) or frozen (SIGSTOP) one at a time, as a crash or a deadlock would. The run
replaces each, finishes every step with all its prompts, saves its final policy, and leaves no process behind. A
learner rank whose allocation fails inside a real step restarts the learner group, and the same failure at the same
step again stops the run naming what to change."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from functools import partial
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import TESTS_DIR, headed_cluster, injected, small_config, train_config_here
from test_resume import training

from grpo_dist.storage import status

pytestmark = pytest.mark.slow

FAULTS = [  # (what is done, to which actor class, in which of its calls, by which signal, the counter counting it)
    ("generator killed", "Generator", "generate", signal.SIGKILL, "generator_restarts"),
    ("engine killed", "Generator", "generate", signal.SIGKILL, "engine_restarts"),  # its engine core process
    ("reward worker killed", "RewardWorker", "score", signal.SIGKILL, "reward_worker_restarts"),
    ("generator hung", "Generator", "generate", signal.SIGSTOP, "generator_restarts"),
    ("reward worker hung", "RewardWorker", "score", signal.SIGSTOP, "reward_worker_restarts"),
    ("learner rank killed", "Learner", "train", signal.SIGKILL, "learner_restarts"),
    ("learner rank hung", "Learner", "train", signal.SIGSTOP, "learner_restarts"),
    # A generator killed while the learner trains (the generators idle): the weight sync after the step finds it.
    ("generator killed before a weight sync", "Learner", "train", signal.SIGKILL, "generator_restarts"),
]
STEPS = 24
WAIT_S = 600  # for one fault to be handled (a hung actor is detected only at its bound; a learner group restart
# under a loaded machine, another test beside it, once took over 300 s)


def actor_processes(driver: psutil.Process, actor_class: str) -> list[psutil.Process]:
    """The run's actor processes of one class: Ray titles an actor's process `ray::<class>[.<method>]`."""
    return [
        process
        for process in driver.children(recursive=True)
        if title(process).startswith(f"ray::{actor_class}") and process.status() != psutil.STATUS_ZOMBIE
    ]


def title(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def in_call(processes: list[psutil.Process], actor_class: str, method: str) -> psutil.Process | None:
    """The first process running `method` now: Ray titles a busy actor `ray::<class>.<method>`."""
    return next((p for p in processes if title(p).startswith(f"ray::{actor_class}.{method}")), None)


def idle_generator(driver: psutil.Process) -> psutil.Process | None:
    """A generator process not titled as generating, while a learner rank is titled as training."""
    if in_call(actor_processes(driver, "Learner"), "Learner", "train") is None:
        return None
    return next((p for p in actor_processes(driver, "Generator") if ".generate" not in title(p)), None)


def engine_of(generator: psutil.Process) -> psutil.Process | None:
    """The vLLM engine core process a generator started (titled `VLLM::EngineCore...`)."""
    return next((child for child in generator.children() if "EngineCore" in title(child)), None)


def last_row(run_dir) -> dict | None:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1]) if lines else None
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or rewritten right now
        return None


def wait_for(condition, run: subprocess.Popen, what: str, timeout_s: float = WAIT_S, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while (value := condition()) is None or value is False:
        if run.poll() is not None:
            log = Path(run.args[-1]).with_name("run.log")  # `training` writes it beside the config
            said = log.read_text()[-4000:] if log.is_file() else ""
            raise AssertionError(f"the run ended (exit {run.returncode}) while waiting for {what}:\n{said}")
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(poll_s)
    return value


def test_a_run_survives_its_actors_killed_and_hung(tmp_path):
    raw = small_config(
        tmp_path,
        run={"steps": STEPS},
        rollout={"num_generators": 2},
        checkpoint={"every_steps": 2, "keep": 2},
        sync={"timeout_s": 60},  # also the bound on a generator that hangs during a weight sync
        faults={"generate_timeout_s": 10, "score_timeout_s": 8, "train_timeout_s": 10},
    )
    run_dir = tmp_path / "outputs" / "test"
    with training(tmp_path, raw, warm_shared=False) as run:  # its actors found among the driver's descendants
        driver = psutil.Process(run.pid)
        timings, everything = [], []
        wait_for(lambda: (row := last_row(run_dir)) is not None and row["step"] >= 1, run, "first step")
        for what, actor_class, method, sig, counter in FAULTS:
            before = last_row(run_dir)[f"faults/{counter}"]
            actors = wait_for(lambda c=actor_class: actor_processes(driver, c), run, f"a {actor_class} process")
            everything += driver.children(recursive=True)
            victim = wait_for(
                partial(in_call, actors, actor_class, method), run, f"{actor_class}.{method}", poll_s=0.005
            )
            if what.startswith("engine"):  # the generator's process lives on; its engine is gone
                victim = wait_for(partial(engine_of, victim), run, "the generator's engine process")
            if what.endswith("before a weight sync"):  # one holding no request, while the learner trains
                victim = wait_for(partial(idle_generator, driver), run, "a generator idle while the learner trains")
            os.kill(victim.pid, sig)  # in the middle of its call
            sent = time.monotonic()
            wait_for(lambda c=counter, b=before: (row := last_row(run_dir)) and row[f"faults/{c}"] > b, run, what)
            timings.append((what, time.monotonic() - sent))
        assert run.wait(timeout=900) == 0, (tmp_path / "run.log").read_text()[-3000:]
    output = (tmp_path / "run.log").read_text()
    for what, seconds in timings:
        print(f"{what}: handled (next step logged) {seconds:.1f} s after the signal")

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))  # none missing, none twice after the restart
    fault_lines = [line for line in output.splitlines() if line.startswith("fault: ")]
    final = rows[-1]
    counters = ("generator_restarts", "engine_restarts", "reward_worker_restarts")
    restarts = tuple(final[f"faults/{name}"] for name in counters)
    assert restarts == (3, 1, 2), "\n".join(fault_lines)
    assert final["faults/learner_restarts"] == 2, "\n".join(fault_lines)
    assert final["faults/unscored"] == 0  # every lost share was scored again
    # A generator holds one request at a time here, so each of the four generator faults loses at most one. One
    # killed or frozen just as its answer left (its process still titled generate), or killed "idle" by a title that
    # lags under load, may be found by the next weight sync holding none. What each loss took is in its fault line.
    lost = [int(n) for n in re.findall(r"while generating (\d+) prompts", "\n".join(fault_lines))]
    assert final["faults/regenerated"] == sum(lost) and 1 <= len(lost) <= 4 and set(lost) == {1}, fault_lines
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert len(fault_lines) == 8, fault_lines  # one line per fault, naming the actor and what was done
    assert any(line.startswith("fault: generator ") and "failed (engine died" in line for line in fault_lines)
    hung = re.compile(r"no answer within 10 s \(faults.generate_timeout_s\) \[stacks: \S+\] while generating")
    assert any(line.startswith("fault: generator ") and hung.search(line)
               for line in fault_lines)  # fmt: skip
    assert any(line.startswith("fault: reward worker ") and "died" in line for line in fault_lines)
    assert any(
        line.startswith("fault: learner rank ") and "restarted the learner group" in line for line in fault_lines
    )
    stalled = re.compile(r"train made no progress for 10 s \(faults.train_timeout_s\) \[stacks: \S+\]; restarted the")
    assert any(line.startswith("fault: learner rank(s) [0]: ") and stalled.search(line) for line in fault_lines)
    # Each of the three hung actors left its stack where its fault line says, read from outside its stopped process.
    named = [Path(path) for path in re.findall(r"\[stacks: (\S+)\]", "\n".join(fault_lines))]
    assert sorted(named) == sorted((run_dir / "stalls").glob("*.txt")) and len(named) == 3, fault_lines
    for path in named:
        text = path.read_text()
        assert "(not read" not in text and "Thread " in text, text
    learner = next(path for path in named if path.read_text().startswith("# learner train"))
    # the process in its train call (by its title: the signal may land while the call's arguments are unpacked)
    assert "ray::Learner.train" in learner.read_text()
    newest = max(named, key=lambda path: path.stat().st_mtime)
    shown = f"stalls: 3 stack dump(s) of actors a wait gave up on, the latest {newest}"
    assert any(line.strip() == shown for line in status.summary(run_dir)), status.summary(run_dir)
    # No process of the run outlives it: the replaced actors, the frozen ones and Ray's own.
    _, alive = psutil.wait_procs(everything, timeout=60)
    assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []


def node_actors(node, actor_class: str) -> list[psutil.Process]:
    """Actor processes of one class on a node of a `ray.cluster_utils.Cluster` (children of the node's raylet)."""
    (raylet,) = node.all_processes["raylet"]
    return actor_processes(psutil.Process(raylet.process.pid), actor_class)


def test_a_run_survives_losing_a_node(tmp_path, monkeypatch):
    """Three Ray nodes on this machine (the head holds no actors); once a checkpoint exists, the node holding the
    learner rank (and generators) is removed with everything on it. The learner group is restarted from the
    checkpoint and the other actors replaced, on the remaining node, and the run ends."""
    # The nodes' workers import the test's reward functions.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])))
    cluster = headed_cluster()
    workers = [cluster.add_node(num_cpus=4) for _ in range(2)]  # either holds the whole run
    raw = small_config(
        tmp_path,
        run={"steps": 12},
        rollout={"num_generators": 2},
        checkpoint={"every_steps": 2, "keep": 2},
        sync={"timeout_s": 120},
        faults={"generate_timeout_s": 10, "score_timeout_s": 8},
        ray={"address": cluster.address},
    )
    run_dir = tmp_path / "outputs" / "test"
    try:
        with training(tmp_path, raw) as run:
            wait_for(lambda: (run_dir / "checkpoints" / "latest").is_file(), run, "a checkpoint")
            (lost,) = [node for node in workers if node_actors(node, "Learner")]
            generators_lost = len(node_actors(lost, "Generator"))
            cluster.remove_node(lost, allow_graceful=False)
            started = time.monotonic()
            wait_for(
                lambda: (row := last_row(run_dir)) and row["faults/learner_restarts"] >= 1,
                run,
                "a restarted learner group",
            )
            print(f"node lost: handled (next step logged) {time.monotonic() - started:.1f} s after its removal")
            assert run.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        cluster.shutdown()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 13))
    assert rows[-1]["faults/learner_restarts"] == 1
    assert rows[-1]["faults/generator_restarts"] >= generators_lost
    assert rows[-1]["faults/unscored"] == 0
    assert (run_dir / "final" / "model.safetensors").is_file()


def test_a_generator_that_does_not_start_within_faults_start_timeout_s_is_named(ray_cluster, tmp_path):
    from grpo_dist.cluster.generator_pool import GeneratorPool
    from grpo_dist.cluster.placement import place
    from grpo_dist.config import load_config
    from grpo_dist.faults import FaultLog, RunFailed
    from grpo_dist.run.inputs import prepare_model

    # An engine takes seconds to load, so a 0.5 s start bound passes first; the sync bound (600 s) plays no part.
    config = tmp_path / "start.yaml"
    config.write_text(yaml.safe_dump(small_config(tmp_path, faults={"start_timeout_s": 0.5})))
    cfg = load_config(config)
    placement = place(cfg)
    generators = GeneratorPool(cfg, prepare_model(cfg), placement, FaultLog())
    try:
        with pytest.raises(RunFailed, match=r"generator 0 did not start within 0.5 s \(faults.start_timeout_s\)"):
            generators.pool.wait_ready()
    finally:
        generators.shutdown()
        placement.remove()


def test_a_slow_step_is_not_a_hang_and_out_of_memory_twice_at_one_step_stops_the_run(ray_cluster, capfd, tmp_path):
    """One run, two learner faults.
    - Training step 3 is slowed, as a machine shared with other work would slow it: an injected fault holds each of
      its 64 micro-batches back 0.15 s after its backward pass (`faults.inject.slow_training`), so the step lasts
      about 10 s, twice `faults.train_timeout_s`, on any machine, and goes on to the end without a restart, because its
      micro-batches keep finishing. (Stopping the learner's process from outside, as this test once did, slowed
      whatever part of step 3 was left when step 2 was logged: on a fast machine, too little of it.)
    - Then each learner rank asks for more memory than the machine has inside training step 4 (a real allocation
      failure in a real step): the learner group is restarted from the step-3 checkpoint, step 4 fails the same
      way again, and the run stops, naming the settings that make a step smaller."""
    bound_s = 5.0
    held_s = 0.15
    raw = small_config(
        tmp_path,
        run={"steps": 6},
        data={"prompts_per_step": 16},  # 64 completions: 64 micro-batches of one completion each
        learner={"lr": 1e-2, "micro_batch_size": 1, "zero_stage": 2},
        checkpoint={"every_steps": 1, "keep": 2},
        faults={"train_timeout_s": bound_s},
    )
    raw = injected(raw, slow_training={"step": 3, "seconds": held_s}, fail_allocation_at_step=4)
    run_dir = tmp_path / "outputs" / "test"
    code, output = train_config_here(capfd, tmp_path, raw)
    assert code == 1, output[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]  # step 4 never finished
    assert rows[-1]["faults/learner_restarts"] == 0  # the slow steps: no restart
    usual, slowed = rows[1]["time/learner_busy"], rows[2]["time/learner_busy"]
    print(
        f"training step: {usual:.2f} s as usual, {slowed:.2f} s slowed ({held_s:g} s after each micro-batch); "
        f"bound on progress {bound_s:g} s"
    )
    assert slowed > bound_s  # a bound on the step's length would have fired

    fault_lines = [line for line in output.splitlines() if line.startswith("fault: ")]
    assert len(fault_lines) == 1, output[-3000:]
    assert "learner rank 0 failed (out of memory" in fault_lines[0], fault_lines
    assert "restarted the learner group from step 3" in fault_lines[0], fault_lines
    stop = next(line for line in output.splitlines() if "the same failure at step 4 a second time" in line)
    for setting in ("learner.micro_batch_size (now 1)", "rollout.max_new_tokens (now 4)",
                    "learner.gradient_checkpointing", "learner.offload"):  # fmt: skip
        assert setting in stop, stop
    assert (run_dir / "interrupted").is_dir()  # what the run had is kept
