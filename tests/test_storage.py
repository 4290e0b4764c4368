"""One place for a run's files on a cluster whose nodes have disks of their own: a real two-node Ray cluster on this
machine, its worker node started in a mount namespace of its own with a tmpfs over part of the filesystem, so a path
there is a different directory on each node (as a node-local disk is). All the run's actors land on that node (the
head has no CPUs). A run whose `run.output_dir` the learner's node cannot see stops before any engine starts,
naming the node and the path; one on a directory both nodes see completes, and `--resume` continues from its
checkpoint; one in an S3 object store (a moto server the test starts on this machine) is staged on each node's own
disk, uploaded, and `--resume` downloads its checkpoint and continues."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import yaml
from conftest import REPO, small_config
from ray_nodes import (
    RAY,
    cluster_cpus,
    free_port,
    node_env,
    node_root,
    own_ports,
    private_mounts_work,
    ray_start_in_shell,
    stop_processes_under,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s3_server():
    """The environment that points the S3 client of every process at an S3 server on this machine, with its bucket
    `runs`."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip
    bucket = pafs.S3FileSystem(endpoint_override=f"{host}:{port}", scheme="http", access_key="test", secret_key="test",
                               region="us-east-1", allow_bucket_creation=True)  # fmt: skip
    bucket.create_dir("runs")
    with pytest.MonkeyPatch.context() as patch:  # this process's own reads of the store, and the nodes it starts
        for name, value in env.items():
            patch.setenv(name, value)
        yield env
    server.stop()


@pytest.fixture(scope="module")
def private_disk_cluster(s3_server):
    """(address, a directory private to the worker node, a directory both nodes see). Every node's environment
    reaches the S3 server."""
    root = node_root("nodes")
    private, shared = root / "private", root / "shared"
    private.mkdir()
    shared.mkdir()
    if not private_mounts_work(private):
        pytest.skip("this machine does not let a process mount a tmpfs in its own mount namespace (needs root)")
    env = node_env()
    address = f"127.0.0.1:{free_port()}"
    head = [RAY, "start", "--head", f"--port={address.split(':')[1]}", "--num-cpus=0", f"--temp-dir={root / 'head'}",
            "--include-dashboard=false", "--disable-usage-stats", *own_ports()]  # fmt: skip
    try:
        subprocess.run(head, check=True, env=env, capture_output=True, timeout=120)
        join_worker(address, private, root, env)
        yield address, private, shared
    finally:
        stop_processes_under(root)
        shutil.rmtree(root, ignore_errors=True)


def join_worker(address: str, private: Path, root: Path, env: dict, attempts: int = 3) -> None:
    """Start the worker node in its own mount namespace (a tmpfs on `private`) and wait until it has joined. The wait
    reads the node's own output (`ray start` says when its raylet has registered) and asks the cluster once then: a
    `ray status` a second would be a Ray client's start-up a second, CPU the starting node needs on a busy machine.
    A `ray start` that exits (a port taken between choosing it and binding it, or its raylet not registered within
    the 30 s Ray allows, which a machine busy with the suite's other worker can take) is tried again on new ports; the
    failure names the node's own output."""
    for attempt in range(1, attempts + 1):
        log = root / f"worker-{attempt}.log"
        temp_dir, ports = root / f"worker-{attempt}", " ".join(own_ports())
        warm_dir = root / f"warm-{attempt}"  # its workers forked from a warm process that sees its private disk
        worker = (f"mount -t tmpfs tmpfs {private} && {ray_start_in_shell(warm_dir)} --address={address} --num-cpus=4 "
                  f"--temp-dir={temp_dir} --disable-usage-stats --block {ports}")  # fmt: skip
        with log.open("w") as out:
            node = subprocess.Popen(["unshare", "-m", "sh", "-c", worker], env=env, start_new_session=True,
                                    stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 180
        while "Ray runtime started" not in log.read_text() and node.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        while node.poll() is None and time.monotonic() < deadline:  # started: its CPUs as the cluster counts them
            if cluster_cpus(address) >= 4:
                return
            time.sleep(2)
        assert node.poll() is not None and attempt < attempts, (
            f"the worker node did not join: {log.read_text()[-2000:]}"
        )


def train(tmp_path: Path, address: str, output_dir: Path | str, *args: str, steps: int = 2, model: Path | None = None,
          **run) -> subprocess.CompletedProcess:  # fmt: skip
    raw = small_config(tmp_path, run={"output_dir": str(output_dir), "steps": steps, **run}, ray={"address": address},
                       checkpoint={"every_steps": 2})  # fmt: skip
    raw["model"]["path"] = str(model or Path(output_dir).parent / "model")  # built by the driver, read by the actors
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    command = [sys.executable, "-m", "grpo_dist", "train", str(config), *args]
    run = subprocess.Popen(command, cwd=REPO, env=node_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)  # fmt: skip
    try:
        out, err = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(run.args, run.returncode, out, err)


def test_an_output_dir_the_learners_node_cannot_see_stops_the_run_naming_node_and_path(private_disk_cluster, tmp_path):
    address, private, _ = private_disk_cluster
    result = train(tmp_path, address, private / "outputs")
    assert result.returncode == 2, result.stderr[-3000:]
    probe = private / "outputs" / "test" / ".grpo-dist-probe"
    assert re.search(rf"learner rank 0's node \(\S+\) cannot see {re.escape(str(probe))}", result.stderr), result.stderr
    assert "Traceback" not in result.stderr
    assert "Generator" not in result.stdout + result.stderr  # stopped before any engine started


def test_a_shared_output_dir_holds_the_whole_checkpoint_and_resume_continues(private_disk_cluster, tmp_path):
    address, _, shared = private_disk_cluster
    outputs = shared / "outputs"
    first = train(tmp_path, address, outputs)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = outputs / "test"
    checkpoint = run_dir / "checkpoints" / "step-000002"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-000002"
    shards = sorted(path.name for path in (checkpoint / "learner" / "state").iterdir())
    assert any(name.endswith("model_states.pt") for name in shards), shards  # written by the rank on the worker
    assert any("optim_states" in name for name in shards), shards
    assert (run_dir / "final" / "model.safetensors").is_file()
    resumed = train(tmp_path, address, outputs, "--resume", steps=4)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoint} after step 2" in resumed.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert [row["rollout/weight_version"] for row in rows] == [0, 1, 2, 3]  # step 3 trained on the restored weights


def test_an_object_store_holds_the_whole_checkpoint_and_resume_downloads_it(private_disk_cluster, tmp_path):
    """Staged on a directory private to each node (the driver's and the learner's are different disks): every file
    of the run reaches the store only by upload, and the resume (and `grpo-dist eval` of a checkpoint there) only by
    download."""
    from grpo_dist.storage import Store

    address, private, shared = private_disk_cluster
    staging, uri = private / "staging", "s3://runs/outputs"
    first = train(tmp_path, address, uri, model=shared / "s3-model", staging_dir=str(staging))
    assert first.returncode == 0, first.stderr[-3000:]
    store = Store(uri)
    assert store.read_text("test/checkpoints/latest").strip() == "step-000002"
    shards = store.children("test/checkpoints/step-000002/learner/state")
    assert any(name.endswith("model_states.pt") for name in shards), shards  # uploaded by the learner's node
    assert any("optim_states" in name for name in shards), shards
    assert "run_state.pt" in store.children("test/checkpoints/step-000002")  # uploaded by the driver
    assert "model.safetensors" in store.children("test/final")
    assert f"run test ({uri}/test): finished" in first.stdout
    torn = store.read_text("test/metrics.jsonl") + '{"step": 3, "reward/mean": 0.'  # as a kill mid-row leaves it
    store.write_text("test/metrics.jsonl", torn)
    resumed = train(tmp_path, address, uri, "--resume", steps=4, model=shared / "s3-model", staging_dir=str(staging))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {uri}/test/checkpoints/step-000002 after step 2" in resumed.stdout
    assert "metrics.jsonl: dropped its last line, torn by a crash mid-write" in resumed.stdout
    rows = [json.loads(line) for line in store.read_text("test/metrics.jsonl").splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]  # the first run's rows downloaded and continued
    assert [row["rollout/weight_version"] for row in rows] == [0, 1, 2, 3]  # step 3 trained on the restored weights
    assert store.read_text("test/checkpoints/latest").strip() == "step-000004"

    # The checkpoint evaluated straight from the store: the same greedy answers as the run's evaluation after step 4.
    checkpoint = f"{uri}/test/checkpoints/step-000004"
    command = [sys.executable, "-m", "grpo_dist", "eval", str(tmp_path / "run.yaml"), "--checkpoint", checkpoint,
               "--out", str(tmp_path / "e.json")]  # fmt: skip
    evaluated = subprocess.run(command, cwd=REPO, env=node_env(), capture_output=True, text=True, timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    after = json.loads(store.read_text("test/eval.jsonl").splitlines()[-1])
    assert after["step"] == 4
    standalone = json.loads((tmp_path / "e.json").read_text())
    assert standalone["eval/held_out/accuracy"] == after["eval/held_out/accuracy"]
    assert f"eval held_out of {checkpoint}: accuracy" in evaluated.stdout
