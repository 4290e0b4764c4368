"""Overlap: batches drawn ahead with every sample's staleness bounded, and generators added and removed while a run
goes. The loop tests run the real Ray, vLLM and DeepSpeed stack."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, TESTS_DIR, cli_here, headed_cluster, injected, small_config, warm_nodes
from test_resume import grpo_dist, training

from grpo_dist.config import ConfigError, load_config, validate_config
from grpo_dist.sandbox import jail
from grpo_dist.storage import control
from grpo_dist.types import Sampling


def test_off_policy_correction_is_on_by_default_once_samples_can_be_stale(tmp_path):
    def algorithm(rollout: dict | None = None, **settings):
        resolved = validate_config(small_config(tmp_path, rollout=rollout or {}, algorithm=settings)).algorithm
        return resolved.old_logprobs, resolved.is_cap

    stale = {"max_staleness": 1}
    assert algorithm() == ("learner", None)  # on-policy: the learner's own logprobs, nothing to correct
    assert algorithm(stale) == ("sampler", None)  # the ratio is taken against the weights that sampled
    assert algorithm(stale, old_logprobs="learner") == ("learner", 2.0)  # truncated importance sampling instead
    assert algorithm(stale, is_cap=3.0) == ("learner", 3.0)  # a cap asks for truncated importance sampling
    assert algorithm({**stale, "top_p": 0.9}) == ("learner", 2.0)  # a truncated sampler would read as a policy change
    assert algorithm(stale, old_logprobs="learner", is_cap=None) == ("learner", None)  # no correction at all
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(small_config(tmp_path)))
    with pytest.raises(ConfigError, match="is_cap must be > 0"):
        load_config(config, ["algorithm.is_cap=0"])
    with pytest.raises(ConfigError, match="is_cap=2.0 does nothing with algorithm.old_logprobs=sampler"):
        load_config(config, ["algorithm.old_logprobs=sampler", "algorithm.is_cap=2.0"])


def test_a_scale_request_is_checked_written_whole_and_taken_once(tmp_path, capfd):
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        control.scale(tmp_path, generators=2)
    (tmp_path / "config.yaml").write_text("{}")
    with pytest.raises(ValueError, match="generators must be a whole number >= 1"):
        control.scale(tmp_path, generators=0)
    with pytest.raises(control.NotRunning, match="the run is not running .* set rollout.num_generators when you"):
        control.scale(tmp_path, generators=3)  # a finished run: nothing would take it but a later resume
    assert not (tmp_path / control.REQUEST).exists()
    (tmp_path / control.REQUEST).write_text('{"generators": 1}')  # left by hand before the run: not the run's
    running = control.Running(tmp_path)  # what a run holds while it trains (Ray not connected: no mailbox)
    with pytest.raises(control.NotRunning, match="another process runs this run already"):
        control.Running(tmp_path)
    assert running.take() is None
    control.scale(tmp_path, generators=3)
    assert running.take() == 3 and running.take() is None  # consumed
    running.close()
    assert not control.is_running(tmp_path)
    running = control.Running(tmp_path)
    control.scale(tmp_path, generators=3)
    assert control.take_request(tmp_path) == 3
    assert control.take_request(tmp_path) is None  # consumed
    (tmp_path / control.REQUEST).write_text('{"generators": "two"}')
    assert control.take_request(tmp_path) is None
    assert "ignored" in capfd.readouterr().out
    done = cli_here(capfd, "scale", str(tmp_path), "workers=2", cwd=REPO)
    assert done.returncode == 2 and "expected generators=N" in done.stderr
    running.close()
    refused = cli_here(capfd, "scale", str(tmp_path), "generators=2", cwd=REPO)
    assert refused.returncode == 2 and "the run is not running (it finished or stopped)" in refused.stderr


def test_another_user_cannot_lock_a_run_directory_and_keep_the_run_from_starting(tmp_path):
    """Any user who can open a file can `flock` it: the lock is on a file only the run's user may open, so another
    user (`nobody`, here) can neither take it nor read it, and the run starts."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to act as another user")
    shared = Path(tempfile.mkdtemp(prefix="grpo-lock-test-"))
    try:
        run_dir = shared / "run"
        run_dir.mkdir()
        shared.chmod(0o755)
        run_dir.chmod(0o755)  # a run directory others may read, as outputs often are
        control.Running(run_dir).close()  # a first run made the lock file
        read_end, write_end = os.pipe()
        taker = os.fork()
        if taker == 0:  # another user, holding what locks it could take until it is killed
            os.setgroups([])
            os.setgid(jail.NOBODY)
            os.setuid(jail.NOBODY)
            held, said = [], b""
            for path, flags in [(run_dir, os.O_RDONLY | os.O_DIRECTORY), (run_dir / control.LOCK, os.O_RDONLY)]:
                try:
                    held.append(os.open(path, flags))
                    fcntl.flock(held[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
                    said += f"{path.name}: locked\n".encode()
                except OSError as error:
                    said += f"{path.name}: refused: {error.strerror}\n".encode()
            os.write(write_end, said)
            time.sleep(60)
            os._exit(0)
        os.close(write_end)
        try:
            said = os.read(read_end, 4096).decode().splitlines()
            assert said[1] == ".lock: refused: Permission denied", said  # the directory it may lock, not the file
            control.Running(run_dir).close()  # the run starts all the same
        finally:
            os.kill(taker, signal.SIGKILL)
            os.waitpid(taker, 0)
            os.close(read_end)
        assert stat.S_IMODE((run_dir / control.LOCK).stat().st_mode) == 0o600
    finally:
        shutil.rmtree(shared)


# The engine settings of every run here: one set of actors serves them all (`shared_actors`).
ENGINE = {"max_model_len": 128}


def train_rows(shared, raw: dict) -> tuple[Path, list[dict]]:
    """Train the config `raw` to the end on the shared actors; the run directory and its metrics rows, one per
    step."""
    from grpo_dist.run.driver import train

    cfg = validate_config(shared.config(raw))
    with shared.use(cfg) as cluster:
        run_dir = train(cfg, cluster)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, cfg.run.steps + 1))
    return run_dir, rows


@pytest.mark.slow
@pytest.mark.parametrize(
    ("k", "mode"), [(1, "between_batches"), (2, "between_batches"), (1, "in_flight")], ids=["k1", "k2", "k1-in-flight"]
)
def test_every_trained_sample_is_at_most_k_versions_old(shared_actors, tmp_path, k, mode):
    steps = 6
    rollout = {"max_staleness": k, **ENGINE}
    # In flight, the weights go by delta sync (whose exactness test_delta_sync checks): it must keep the loop going.
    sync = {"mode": mode, "delta": mode == "in_flight", "full_every": 3}
    raw = small_config(tmp_path, run={"steps": steps}, rollout=rollout, sync=sync)
    if mode == "in_flight":
        # Generation outlasts training (each group held 0.5 s once sampled, 2 s a batch, against a tiny model's step
        # of about 0.1 s): updates land mid-batch, and the groups sampled before them are a version older.
        (tmp_path / "slow_s").write_text("0.5")
        raw = injected(raw, slow_generation_file=str(tmp_path / "slow_s"))
    run_dir, rows = train_rows(shared_actors, raw)
    cfg = validate_config(raw)
    # staleness/max is the largest over the step's samples: the bound holds for each one, and is reached.
    assert all(row["staleness/max"] <= k for row in rows)
    assert max(row["staleness/max"] for row in rows) == k
    assert all(row["staleness/dropped"] == 0 for row in rows)  # the syncs kept every batch within the bound
    assert all(row["staleness/max"] >= 1 for row in rows[1:])  # from step 2 on, each batch was drawn ahead
    # Off-policy correction on by default: the ratio is taken against the sampling policy, so it moves off 1 once
    # the sampler is older than the learner. Against the learner's own logprobs, with one update a step, it would be
    # exactly 1.
    assert all(row["ratio/mean"] != 1.0 for row in rows[1:]), [row["ratio/mean"] for row in rows]
    assert all(row["queue/prompts"] == cfg.data.prompts_per_step for row in rows[:-1])
    # The generators' weights after each step: k = 1 syncs every step, k = 2 every other one.
    synced = {1: [1, 2, 3, 4, 5, 6], 2: [0, 2, 2, 4, 4, 6]}[k]
    assert [row["weight_version"] for row in rows] == synced
    assert (run_dir / "final" / "model.safetensors").is_file()
    in_flight = [row["sync/in_flight"] for row in rows]
    print(f"syncs in flight per step: {in_flight}; completions spanning versions: "
          f"{[row['staleness/spanning'] for row in rows]}")  # fmt: skip
    if mode == "between_batches":
        assert not any(in_flight) and not any(row["staleness/spanning"] for row in rows)
        assert not any("sync/delta" in row and row["sync/delta"] for row in rows)
    else:
        assert any(in_flight)  # at least one batch took the learner's new weights mid-way
        # Deltas, and every third sync on these engines full. The first is full (nothing is known of the engines);
        # on actors an earlier run used, that was the initial model's load before step 1, so step 1's is a delta.
        deltas = [row["sync/delta"] for row in rows]
        assert 1.0 in deltas and 0.0 in deltas, deltas
        assert all(0.0 < row["sync/changed_fraction"] <= 1.0 and row["sync/sent_mb"] > 0 for row in rows)


@pytest.mark.slow
def test_dynamic_sampling_refills_from_the_stream_under_in_flight_updates(shared_actors, tmp_path):
    """About half the prompts' groups teach nothing (their rewards are all equal): each step streams more prompts as
    such groups are scored, and trains on exactly `prompts_per_step` informative groups."""
    steps, wanted = 5, 4  # 4 prompts per step (small_config)
    raw = small_config(
        tmp_path, run={"steps": steps}, sync={"mode": "in_flight"}, algorithm={"dynamic_sampling": True},
        rollout={"max_staleness": 1, "max_new_tokens": 48, **ENGINE},
    )  # fmt: skip
    raw["reward"]["functions"] = [{"name": "reward_fixtures.half_informative_reward", "weight": 1.0}]
    _, rows = train_rows(shared_actors, raw)
    used = [row["dynamic_sampling/rounds"] * wanted for row in rows]  # prompts drawn up to the last group trained
    print(f"prompts used per step: {used}; sent past them: {[row['dynamic_sampling/discarded'] for row in rows]}")
    assert all(row["rollout/groups"] == wanted for row in rows)
    assert any(count > wanted for count in used)  # some steps refilled
    for row, count in zip(rows, used, strict=True):  # the prompts used held exactly the groups trained on
        assert round(count * (1 - row["dynamic_sampling/dropped_fraction"])) == wanted
    assert all(row["staleness/max"] <= 1 for row in rows)


@pytest.mark.slow
def test_generators_added_and_removed_while_a_run_goes(tmp_path):
    """1 generator, 2 from the first step after a `grpo-dist scale` request, then 1 again; every step trains on
    all its prompts and each generator's completions show in metrics.jsonl."""
    prompts, group = 4, 4
    raw = small_config(
        tmp_path, run={"steps": UNTIL_STOPPED}, rollout={"num_generators": 1, "group_size": group}, ray={"num_cpus": 4}
    )  # the run's own Ray cluster has room for a second generator
    run_dir = tmp_path / "outputs" / "test"
    with training(tmp_path, raw) as run:
        wait_for_row(run_dir, run, lambda row: row["step"] >= 2)
        assert grpo_dist("scale", str(run_dir), "generators=2").wait(timeout=60) == 0
        up = wait_for_row(run_dir, run, lambda row: row["generators/count"] == 2)
        wait_for_row(run_dir, run, lambda row: row["step"] >= up["step"] + 2)
        control.scale(run_dir, generators=1)  # the same from Python
        down = wait_for_row(run_dir, run, lambda row: row["step"] > up["step"] + 2 and row["generators/count"] == 1)
        wait_for_row(run_dir, run, lambda row: row["step"] >= down["step"] + 2)
        stop(run, tmp_path)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, len(rows) + 1))
    counts = [int(row["generators/count"]) for row in rows]
    assert [c for i, c in enumerate(counts) if i == 0 or c != counts[i - 1]] == [1, 2, 1]  # up once, down once
    for row in rows:  # all of the step's prompts generated, by the generators it had
        per_generator = [row.get(f"generators/{slot}/completions", 0) for slot in range(2)]
        assert sum(per_generator) == prompts * group
        assert all(per_generator[: int(row["generators/count"])])
    output = (tmp_path / "run.log").read_text()
    assert "scale: 1 -> 2 generators" in output and "scale: now 2 generators" in output
    assert "scale: 2 -> 1 generators" in output and "scale: now 1 generators" in output


UNTIL_STOPPED = 100_000  # steps of a run that a test stops (`stop`) once it has seen what it waits for: a new
# generator takes seconds to start, a step here a fraction of one, so no fixed length is sure to outlast it


def stop(run: subprocess.Popen, tmp_path) -> None:
    """Stop a run as preemption would (SIGTERM): it finishes cleanly with status 130."""
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=300) == 130, (tmp_path / "run.log").read_text()[-3000:]


def wait_for_row(run_dir, run: subprocess.Popen, condition, timeout_s: float = 300) -> dict:
    """The first metrics row meeting `condition`, waiting for the run to log it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if run.poll() is not None:
            log = Path(run_dir).parents[1] / "run.log"  # where `training` writes the run's output
            tail = log.read_text()[-4000:] if log.exists() else "(no run.log)"
            raise AssertionError(f"the run ended (exit {run.returncode}) before the awaited step:\n{tail}")
        try:
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        except FileNotFoundError:
            lines = []
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break  # being written
            if condition(row):
                return row
        time.sleep(0.1)
    raise AssertionError(f"no metrics row met the condition within {timeout_s} s")


def test_generators_share_prompts_by_half_an_even_share_and_a_lone_one_takes_all():
    from grpo_dist.cluster.generator_pool import requests_per_generator

    assert [requests_per_generator(16, g) for g in (1, 2, 3, 4)] == [16, 4, 3, 2]
    assert requests_per_generator(16, 1, lone_takes_all=False) == 8  # evaluation, in-flight updates
    assert requests_per_generator(1, 4) == 1 and requests_per_generator(0, 1) == 1


def test_a_generators_share_goes_in_about_four_calls_and_a_small_one_a_prompt_a_call():
    from grpo_dist.cluster.generator_pool import prompts_per_call

    assert [prompts_per_call(depth) for depth in (1, 2, 4, 5, 8, 16, 32, 100)] == [1, 1, 1, 2, 2, 4, 8, 25]


def test_a_generator_counts_as_hung_only_after_a_bound_without_answers():
    """A slot's time without progress starts at its last answer, or at the sending of its oldest request under way
    if that is later: a long queue in an engine that keeps answering is not a hang."""
    from grpo_dist.cluster.generator_pool import GeneratorPool, Request

    pool = object.__new__(GeneratorPool)  # the bookkeeping alone, no generators
    pool.answered = {0: 40.0, 1: 5.0}
    running = {
        "a": Request(0, (0,), 10.0, None), "b": Request(0, (1, 2), 50.0, None),  # queued since 10, answered at 40
        "c": Request(1, (3,), 30.0, None),  # sent at 30, last answer (an earlier batch's) at 5
        "d": Request(2, (4,), 20.0, None), "e": Request(2, (5,), 25.0, None),  # never answered
    }  # fmt: skip
    assert pool._progress(running) == {0: 40.0, 1: 30.0, 2: 20.0}


@pytest.mark.slow
def test_a_slow_generator_takes_fewer_prompts(ray_cluster, tmp_path):
    """Generator 1 is frozen (SIGSTOP, shorter than its bound) while a batch generates, and let go only once
    generator 0 has finished every other prompt: it keeps only the requests it was handed first, generator 0 takes
    all the rest, and the batch comes back whole, in prompt order."""
    import os

    from grpo_dist.cluster.generator_pool import GeneratorPool, requests_per_generator
    from grpo_dist.cluster.placement import place
    from grpo_dist.faults import FaultLog
    from grpo_dist.run.inputs import prepare

    cfg = validate_config(small_config(tmp_path, rollout={"num_generators": 2}, faults={"generate_timeout_s": 60}))
    inputs = prepare(cfg)
    placement = place(cfg)
    pool = GeneratorPool(cfg, inputs.model_path, placement, FaultLog())
    try:
        pool.pool.wait_ready()
        frozen = ray_cluster.get(pool.actors[1].__ray_call__.remote(lambda self: os.getpid()))
        prompts = inputs.train[:16]
        first = requests_per_generator(16, 2)  # 4: half of an even share
        os.kill(frozen, signal.SIGSTOP)
        try:
            generation = pool.start(prompts, group_size=2, seeds=list(range(len(prompts))))
            while len(generation.done) < 16 - first:  # bounded: generator 0 passing its 60 s bound fails the test
                assert not generation.advance().replaced
        finally:
            os.kill(frozen, signal.SIGCONT)
        while not generation.finished:
            assert not generation.advance().replaced
    finally:
        pool.shutdown()
        placement.remove()
    completions = generation.completions()
    assert [c.prompt_index for c in completions] == [index for index in range(len(prompts)) for _ in range(2)]
    assert pool.completions == {0: (16 - first) * 2, 1: first * 2}  # 12 prompts x 2 samples, and 4


@pytest.mark.slow
def test_requests_cancelled_by_the_pool_are_aborted_in_the_engine(ray_cluster, tmp_path):
    """Dynamic sampling's stop: once the step has its groups the generation is cancelled, and the engine
    drops them (vLLM aborts a request whose call is cancelled). The engine is paused with its requests kept before
    the stop, so a request that was not aborted would stay in it rather than finish on its own."""
    from grpo_dist.cluster.generator_pool import GeneratorPool
    from grpo_dist.cluster.placement import place
    from grpo_dist.faults import FaultLog
    from grpo_dist.run.inputs import prepare

    cfg = validate_config(small_config(tmp_path, rollout={"max_new_tokens": 200, "max_model_len": 256}))
    inputs = prepare(cfg)
    placement = place(cfg)
    pool = GeneratorPool(cfg, inputs.model_path, placement, FaultLog())
    engine = pool.actors[0]

    def in_engine() -> int:
        return ray_cluster.get(engine.__ray_call__.remote(lambda self: self.engine.get_num_unfinished_requests()))

    try:
        pool.pool.wait_ready()
        prompts = inputs.train[:8]
        generation = pool.start(prompts, group_size=4, seeds=list(range(len(prompts))))
        for _ in range(200):  # once the engine holds requests, freeze them there and stop
            generation.advance(poll=True)
            if held := in_engine():
                ray_cluster.get(engine._pause.remote())
                break
        generation.cancel()
        completions = generation.completions()
        deadline = time.monotonic() + 30
        while (left := in_engine()) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        pool.shutdown()
        placement.remove()
    assert held > 0, "the engine never held the requests, so there was nothing to cancel"
    assert left == 0, f"{left} cancelled requests still in the (paused) engine after 30 s"
    assert len(completions) < len(prompts) * 4  # the requests were stopped, not generated to the end


@pytest.mark.slow
def test_a_lone_generator_takes_a_batch_in_four_calls_and_samples_what_a_call_per_prompt_samples(ray_cluster, tmp_path):
    """16 prompts to one generator go in 4 calls of 4 (`prompts_per_call`), each prompt still its own engine request
    seeded by its own seed: the groups, in prompt order, are token for token those of one `generate` call each."""
    from grpo_dist.cluster.generator_pool import GeneratorPool
    from grpo_dist.cluster.placement import place
    from grpo_dist.faults import FaultLog
    from grpo_dist.run.inputs import prepare

    cfg = validate_config(small_config(tmp_path, rollout={"max_new_tokens": 8}))
    inputs = prepare(cfg)
    placement = place(cfg)
    pool = GeneratorPool(cfg, inputs.model_path, placement, FaultLog())
    prompts, seeds = inputs.train[:16], [100 + index for index in range(16)]
    try:
        pool.pool.wait_ready()
        generation = pool.start(prompts, group_size=2, seeds=seeds)
        generation._send()  # what the first `advance` sends: every prompt, a lone generator taking all
        calls = [request.prompts for request in generation.running.values()]
        while not generation.finished:
            generation.advance()
        batched = [c.token_ids for c in generation.completions()]
        one_each = ray_cluster.get(
            [pool.actors[0].generate.remote(p.token_ids, 2, None, i, seeds[i]) for i, p in enumerate(prompts)],
            timeout=300,
        )
    finally:
        pool.shutdown()
        placement.remove()
    assert calls == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)], calls
    assert [c.prompt_index for c in generation.completions()] == [index for index in range(16) for _ in range(2)]
    assert batched == [c.token_ids for group in one_each for c in group]
    assert len({tuple(ids) for ids in batched}) > 1  # sampled, not one completion repeated


@pytest.mark.slow
def test_an_update_in_flight_splits_a_completion_between_versions(ray_cluster, tmp_path):
    """New weights loaded while an engine samples long completions: the engine pauses with its requests kept,
    loads them and resumes. A completion under way then holds tokens of both versions and is labelled by the
    oldest (0) with the newest (1) beside it; one sampled afterwards is version 1 throughout. When to load is not
    in the test's hands (the engine may finish first), so it tries a few batches."""
    from safetensors.torch import load_file

    from grpo_dist.cluster.actors.generator import Generator
    from grpo_dist.models.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model")
    rollout = validate_config(small_config(tmp_path, rollout={"max_new_tokens": 200, "max_model_len": 256})).rollout
    generator = ray_cluster.remote(Generator).options(num_cpus=1).remote(str(model_dir), rollout, 0)
    weights = {name: tensor * 1.5 for name, tensor in load_file(str(model_dir / "model.safetensors")).items()}
    try:
        ray_cluster.get(generator.start.remote(), timeout=300)
        in_engine = ray_cluster.get(
            generator.__ray_call__.remote(lambda self: self.engine.vllm_config.model_config.enforce_eager)
        )
        assert in_engine is True  # rollout.enforce_eager null on a CPU: eager (CUDA graphs are for GPUs)
        for version in range(1, 4):
            calls = [generator.generate.remote([1 + index, 2], 16, None, index, index) for index in range(8)]
            time.sleep(0.2)  # let sampling begin
            ray_cluster.get(generator.load_weights.remote(weights, version), timeout=300)
            completions = [c for group in ray_cluster.get(calls, timeout=300) for c in group]
            spanning = [c for c in completions if c.newest_weight_version is not None]
            assert all(c.weight_version in (version - 1, version) for c in completions)
            assert all((c.weight_version, c.newest_weight_version) == (version - 1, version) for c in spanning)
            if spanning:
                break
        assert spanning, "no completion was under way when the weights were loaded"
        greedy = Sampling(temperature=0.0, top_p=1.0, max_tokens=8)
        (after,) = ray_cluster.get(generator.generate.remote([1, 2], 1, greedy, 0), timeout=300)
        assert (after.weight_version, after.newest_weight_version) == (version, None)
    finally:
        ray_cluster.kill(generator)


@pytest.mark.slow
def test_a_generator_waiting_for_room_joins_when_a_node_does(tmp_path, monkeypatch):
    """On a Ray cluster with no room for a second generator, `grpo-dist scale generators=2` leaves the run going
    with one while the new one waits (`generators/joining`); once a node joins, as an autoscaler would add one, the
    new generator starts there and joins the run."""
    # The nodes' workers import the test's reward functions.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])))
    with warm_nodes():
        cluster = headed_cluster()
        cluster.add_node(num_cpus=4)  # the run as it starts: learner rank, one generator, two reward workers
    # A CPU each, so that the node is full: with the reward workers' default quarter CPU a second generator fits at
    # once, and the steps it "waits" are only its start (fewer than the test counts once engines build faster).
    raw = small_config(tmp_path, run={"steps": UNTIL_STOPPED}, ray={"address": cluster.address}, reward={"num_cpus": 1})
    run_dir = tmp_path / "outputs" / "test"
    try:
        with training(tmp_path, raw) as run:
            wait_for_row(run_dir, run, lambda row: row["step"] >= 2)
            control.scale(run_dir, generators=2)
            waiting = wait_for_row(run_dir, run, lambda row: row["generators/joining"] == 1)
            wait_for_row(run_dir, run, lambda row: row["step"] >= waiting["step"] + 3)  # the run goes on meanwhile
            with warm_nodes():
                cluster.add_node(num_cpus=1)
            up = wait_for_row(run_dir, run, lambda row: row["generators/count"] == 2)
            wait_for_row(run_dir, run, lambda row: row["step"] >= up["step"] + 2)
            stop(run, tmp_path)
    finally:
        cluster.shutdown()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, len(rows) + 1))
    counts = [(int(row["generators/count"]), int(row["generators/joining"])) for row in rows]
    assert [c for i, c in enumerate(counts) if i == 0 or c != counts[i - 1]] == [(1, 0), (1, 1), (2, 0)]
    assert sum(c == (1, 1) for c in counts) >= 4  # steps trained while the new generator waited for room
    assert "joined" in (tmp_path / "run.log").read_text()
