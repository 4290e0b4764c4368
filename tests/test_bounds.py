"""Bounds that tell a fault from slow work: errors an engine or a device raises are faults (the actor is replaced),
any other error is a bug; a group's wait stops at its first failure; a call bounded by its progress is waited for
as long as it keeps making progress, and given up once it stops."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
import torch

from grpo_dist.faults import ActorFault, Bound, as_fault, gather, gather_progressing


def test_engine_and_device_errors_are_faults_and_other_errors_are_not():
    from vllm.v1.engine.exceptions import EngineDeadError

    with pytest.raises(RuntimeError) as refused:  # the allocator's own refusal
        torch.empty(1 << 60, dtype=torch.uint8)
    assert as_fault(refused.value).kind == "out of memory"
    assert as_fault(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")).kind == "out of memory"
    assert as_fault(EngineDeadError()).kind == "engine died"
    illegal = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert as_fault(illegal).kind == "device error"
    assert as_fault(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error")).kind == (
        "device error"
    )
    fault = ActorFault("engine died", "gone")
    assert as_fault(fault) is fault
    for bug in (ValueError("bad shape"), RuntimeError("mat1 and mat2 shapes cannot be multiplied"), KeyError("x")):
        assert as_fault(bug) is None


class Worker:
    """Does `pieces` pieces of work of `piece_s` seconds each, then (optionally) stops making progress, or raises."""

    def __init__(self) -> None:
        self.done = 0

    def work(self, pieces: int, piece_s: float, then: str = "") -> int:
        for _ in range(pieces):
            time.sleep(piece_s)
            self.done += 1
        if then == "stall":
            time.sleep(60)
        if then == "out of memory":
            torch.empty(1 << 60, dtype=torch.uint8)
        if then == "bug":
            raise ValueError("a bug in the actor's code")
        return self.done

    @ray.method(concurrency_group="heartbeat")
    def progress(self) -> int:
        return self.done

    def pid(self) -> int:
        return os.getpid()


@pytest.fixture
def workers(ray_cluster):
    """Two fresh actors, made remote as grpo_dist's learner ranks and reward workers are."""
    actor = ray.remote(concurrency_groups={"heartbeat": 1})(Worker)
    made = [actor.options(num_cpus=0).remote() for _ in range(2)]
    ray.get([each.progress.remote() for each in made])  # up, as a run's actors are before they are called
    yield made
    for each in made:
        ray.kill(each)


@pytest.mark.slow
def test_a_call_that_keeps_making_progress_outlasts_its_bound_and_one_that_stops_is_given_up(workers):
    slow, stalled = workers
    calls = [slow.work.remote(8, 0.4), stalled.work.remote(2, 0.4, "stall")]
    bound = Bound(1.5, "faults.train_timeout_s")
    finished, hung = gather_progressing(calls, workers, bound)
    # 3.2 s of work in pieces of 0.4 s: twice its bound, waited for, since each piece moves the count.
    assert finished.ok and finished.value == 8
    assert hung.pending and hung.fault == "made no progress for 1.5 s (faults.train_timeout_s)"
    # The same slow call under a bound on its length is given up: the bound above is on progress, not length.
    (timed_out,) = gather([slow.work.remote(8, 0.4)], bound)
    assert timed_out.pending


@pytest.mark.slow
def test_an_out_of_memory_in_an_actor_is_a_fault_and_a_group_stops_waiting_at_it(workers):
    failing, waiting = workers
    calls = [failing.work.remote(0, 0.0, "out of memory"), waiting.work.remote(1, 30.0)]
    failed, other = gather(calls, Bound(60.0), fail_fast=True)
    assert failed.fault.startswith("failed (out of memory") and failed.kind == "out of memory"
    assert other.pending  # not waited for: its peers in a collective would wait on the failed one
    (bug,) = gather([failing.work.remote(0, 0.0, "bug")], Bound(60.0))
    assert bug.raised and bug.fault is None  # a bug, raised by the caller as such


@pytest.mark.slow
def test_a_role_out_of_restarts_stops_the_run_naming_the_actor_and_the_setting(workers):
    from grpo_dist.faults import ActorPool, FaultLog, RunFailed

    made = iter(workers)  # the pool's first actor, then its replacement
    pool = ActorPool("worker", "worker_restarts", lambda slot: next(made), 1, FaultLog(), 1, Bound(60.0, "start"))
    pool.wait_ready()
    for allowed in (True, False):  # one restart is allowed: the first death is survived, the second is not
        os.kill(ray.get(pool.actors[0].pid.remote()), signal.SIGKILL)
        (outcome,) = pool.call("work", {0: (0, 0.0)}, Bound(60.0)).values()
        assert outcome.fault.startswith("died")
        if allowed:
            pool.replace(0, outcome.fault)
    with pytest.raises(RunFailed, match=r"worker 0 died .*; the run is out of worker restarts \(1\)"):
        pool.replace(0, outcome.fault)
    assert pool.faults.counts["worker_restarts"] == 1


@pytest.mark.slow
def test_actors_a_wait_gives_up_on_leave_their_stacks_named_in_the_fault(workers, tmp_path):
    """One actor stuck in its call (asleep in `work`), one stopped from outside (SIGSTOP) mid-call: the pool's
    wait gives both up at the bound, and their Python stacks, read by py-spy on their node, are in the one file each
    fault names, with the call each was stuck in."""
    from grpo_dist.faults import ActorPool, FaultLog

    made = iter(workers)
    pool = ActorPool("worker", "worker_restarts", lambda slot: next(made), 2, FaultLog(), 1, Bound(60.0, "start"))
    pool.wait_ready()
    stopped = ray.get(pool.actors[1].pid.remote())
    calls = {0: (1, 0.0, "stall"), 1: (600, 0.05)}
    stalls = tmp_path / "run" / "stalls"
    outcomes = {}
    waiter = threading.Thread(
        target=lambda: outcomes.update(pool.call("work", calls, Bound(3.0, "faults.score_timeout_s"), True, stalls))
    )
    waiter.start()
    try:
        time.sleep(1.0)  # both calls under way
        os.kill(stopped, signal.SIGSTOP)
        waiter.join(timeout=120)
    finally:
        os.kill(stopped, signal.SIGCONT)
    assert not waiter.is_alive(), "the wait did not end within 120 s"
    (dump,) = stalls.glob("*.txt")
    for slot in (0, 1):
        assert outcomes[slot].pending
        assert outcomes[slot].fault.endswith(f" [stacks: {dump}]"), outcomes[slot].fault
        assert outcomes[slot].fault.count("[stacks:") == 1, outcomes[slot].fault
    text = dump.read_text()
    print(text)
    assert text.startswith("# worker work made no progress for 3 s (faults.score_timeout_s)")
    sections = dict(part.split("\n", 1) for part in text.split("## ")[1:])
    assert set(sections) == {"worker 0", "worker 1"}
    for name, stack in sections.items():
        assert "work (test_bounds.py:" in stack, f"{name}:\n{stack}"  # the call it was stuck in, read from outside
    assert "(not read" not in text
