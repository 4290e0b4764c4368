"""Checkpoints that cannot be lost, with the real stack through the command line: a run whose whole process group is
killed in the middle of writing a checkpoint goes on from the last complete one when submitted again with
`--resume auto`; a damaged latest checkpoint (half deleted, truncated, or corrupted in place) is passed over, with a
warning, for the newest one that verifies; pruning keeps the checkpoint just written and the one a run resumed from;
a resume over changed data is refused before anything starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from functools import partial
from pathlib import Path

import pytest
import yaml
from conftest import driver_of, kill_run, small_config, train_here
from test_resume import grpo_dist, rows

from grpo_dist.config import load_config
from grpo_dist.data import split_task
from grpo_dist.run.checkpoints import RUN_STATE_CLASSES, STATE, prunable
from grpo_dist.storage import Store, safe_load
from grpo_dist.storage.run_dir import open_run


def test_pruning_keeps_the_newest_written_and_the_resumed_from_whatever_their_steps():
    # --resume of step 10 in a directory that also holds step 50, keep 1: step 20 is written next
    assert prunable(["step-000010", "step-000050", "step-000020"], 1, "step-000020", "step-000010") == ["step-000050"]
    # a directory an earlier run left with a higher step, written before this run's
    assert prunable(["step-000100", "step-000010"], 1, "step-000010", None) == ["step-000100"]
    assert prunable(["step-000001", "step-000002", "step-000003"], 2, "step-000003", None) == ["step-000001"]


def config(tmp_path: Path, name: str, steps: int, keep: int = 3, wandb: bool = False, run=None, model=None,
           **checkpoint) -> Path:  # fmt: skip
    """A run on a data file of its own (so that the data can change), a checkpoint every step; `wandb`: logging
    to W&B offline, into the run directory; `model`: the tiny model's directory (default: in tmp_path)."""
    data = tmp_path / "data"
    if not (data / "train.jsonl").exists():
        split_task("last_digit", data, num_train=64, num_eval=8, seed=0)
    raw = small_config(tmp_path, run={"name": name, "steps": steps, **(run or {})},
                       checkpoint={"every_steps": 1, "keep": keep, **checkpoint})  # fmt: skip
    raw["data"] = {"path": str(data / "train.jsonl"), "max_prompt_tokens": 16, "prompts_per_step": 4}
    raw["model"]["path"] = str(model or tmp_path / "model")
    raw["wandb"] = {"enabled": wandb, "mode": "offline"}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run_cli(*args: str | Path) -> tuple[int, str]:
    process = grpo_dist("train", *map(str, args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = process.communicate(timeout=600)
    return process.returncode, out


@pytest.mark.slow
@pytest.mark.parametrize("where", ["path", "object-store"])
def test_a_run_killed_while_writing_a_checkpoint_goes_on_when_submitted_again(tmp_path, request, where):
    """On a path the checkpoint is caught half-written beside the others; in an object store, half-staged on the
    node's disk with the upload under way. Either way the next submission goes on from the last whole one (on a path
    in this process, on the shared actors; the object store's needs a cluster of its own, whose nodes reach the
    store's server)."""
    store_run = where == "object-store"
    staging = tmp_path / "staging"
    run = {"output_dir": request.getfixturevalue("s3"), "staging_dir": str(staging)} if store_run else {}
    shared = None if store_run else request.getfixturevalue("shared_actors")
    model = shared.model_path if shared else None
    path = config(tmp_path, "killed", steps=100_000, keep=2, wandb=True, run=run, model=model)
    runs = open_run(load_config(path))[1]
    files = RunFiles(runs.store, "killed")
    writing_in = staging / "killed" / "checkpoints" if store_run else tmp_path / "outputs" / "killed" / "checkpoints"
    process = grpo_dist("train", str(path), "--resume", "auto", start_new_session=True)
    driver = driver_of(process)
    caught, whole = None, False
    deadline = time.monotonic() + 600
    try:
        while caught is None and time.monotonic() < deadline:  # a checkpoint is written every step; catch one mid-way
            assert process.poll() is None, "the run ended before it was killed"
            # a whole checkpoint first, then a write under way: the kill follows the sight of the write at once (an
            # object store's read between them took long enough for the write to finish)
            whole = whole or bool(files.read("checkpoints/latest"))
            writing = list(writing_in.glob(".step-*.tmp")) if whole and writing_in.is_dir() else []
            if writing:
                os.killpg(driver.pid, signal.SIGKILL)  # the driver and everything in its process group, at once
                caught = writing[0].name
            else:
                time.sleep(0.001)
    finally:
        if process.poll() is None:
            kill_run(process)
        process.wait(timeout=60)
    assert caught, "no checkpoint was caught being written within 10 minutes"
    assert (writing_in / caught).exists()  # the kill landed mid-write: the partial checkpoint is still there
    latest = files.read("checkpoints/latest").strip()
    last = int(latest.removeprefix("step-"))
    assert f".{latest}.tmp" != caught and files.read(f"checkpoints/{latest}/manifest.json")

    path.write_text(path.read_text().replace("steps: 100000", f"steps: {last + 2}"))
    if store_run:
        code, out = run_cli(path, "--resume", "auto")
    else:
        with shared.use(load_config(path)) as actors:
            code, out = train_here(request.getfixturevalue("capfd"), path, cluster=actors, resume="auto")
    assert code == 0, out[-3000:]
    assert f"resumed from {runs.store.name(f'killed/checkpoints/{latest}')} after step {last}" in out
    steps = [json.loads(line)["step"] for line in files.read("metrics.jsonl").splitlines()]
    assert steps == list(range(1, last + 3))  # every step once: the rows after the checkpoint were dropped and redone
    assert not list(writing_in.glob(".step-*.tmp"))  # what the killed write left is cleared by the next one
    # W&B goes on in the same run: two sessions (killed, resumed) of one run id, the one the checkpoint holds
    sessions = sorted(name for name in files.children("wandb") if name.startswith("offline-run-"))
    state = files.local(f"checkpoints/{latest}", tmp_path / "state")
    assert len(sessions) == 2 and {session.rsplit("-", 1)[1] for session in sessions} == {
        safe_load.load(state / STATE, RUN_STATE_CLASSES)["wandb_id"]
    }


class RunFiles:
    """A run's files where the run keeps them (a path or an object store), read the same way."""

    def __init__(self, store: Store, run: str) -> None:
        self.store, self.run = store, run

    def read(self, key: str) -> str:
        return self.store.read_text(f"{self.run}/{key}") or ""

    def children(self, key: str) -> list[str]:
        return self.store.children(f"{self.run}/{key}")

    def local(self, key: str, scratch: Path) -> Path:
        """The checkpoint `key` of the run, its run state readable here."""
        key = f"{self.run}/{key}"
        if self.store.local:
            return self.store.path(key)
        self.store.download(f"{key}/{STATE}", scratch / STATE)
        return scratch


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_is_passed_over_and_pruning_keeps_what_resuming_needs(shared_actors, capfd,
                                                                                           tmp_path):  # fmt: skip
    """Every run here is the command's in this process, on the shared actors: the first starts from the model, each
    resume loads its checkpoint into them (none is killed)."""
    from grpo_dist.config import load_config

    path = config(tmp_path, "damaged", steps=4, keep=4, model=shared_actors.model_path)
    with shared_actors.use(load_config(path)) as actors:
        run = partial(train_here, capfd, cluster=actors)
        run_dir = tmp_path / "outputs" / "damaged"
        checkpoints = run_dir / "checkpoints"
        code, out = run(path)
        assert code == 0, out[-3000:]
        assert sorted(p.name for p in checkpoints.glob("step-*")) == [f"step-{step:06d}" for step in (1, 2, 3, 4)]

        def shard(step: int) -> Path:
            (model_states,) = (checkpoints / f"step-{step:06d}" / "learner" / "state").glob("*model_states.pt")
            return model_states

        (checkpoints / "step-000004" / "manifest.json").unlink()  # half deleted, as an interrupted prune leaves it
        shard(4).unlink()
        damaged = bytearray(shard(3).read_bytes())  # corrupted in place: same size, other bytes
        damaged[len(damaged) // 2] ^= 0xFF
        shard(3).write_bytes(bytes(damaged))
        shard(2).write_bytes(shard(2).read_bytes()[:-100])  # truncated
        # resumed with keep 1: of what is there, the one written last and the one resumed from (step 1) stay
        path.write_text(path.read_text().replace("steps: 4", "steps: 5").replace("keep: 4", "keep: 1"))
        code, out = run(path, resume=True)
        assert code == 0, out[-3000:]
        assert "checkpoint step-000004 in" in out and "(no manifest.json (an interrupted write or prune" in out
        assert "checkpoint step-000003 in" in out and "does not match its checksum); resuming from step-000001" in out
        assert "checkpoint step-000002 in" in out and "bytes, not" in out
        assert f"resumed from {checkpoints / 'step-000001'} after step 1" in out
        assert [row["step"] for row in rows(run_dir)] == [1, 2, 3, 4, 5]
        assert (checkpoints / "latest").read_text().strip() == "step-000005"
        assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-000001", "step-000005"]

        # --resume PATH: an older checkpoint than the latest, named
        path.write_text(path.read_text().replace("steps: 5", "steps: 6"))
        code, out = run(path, resume=str(checkpoints / "step-000001"))
        assert code == 0, out[-3000:]
        assert f"resumed from {checkpoints / 'step-000001'} after step 1" in out
        assert [row["step"] for row in rows(run_dir)] == [1, 2, 3, 4, 5, 6]

        # other data under the same checkpoint: refused before anything starts, unless allowed (one more step to go:
        # a run already at its last step has nothing to train, whatever its data)
        path.write_text(path.read_text().replace("steps: 6", "steps: 7"))
        train = tmp_path / "data" / "train.jsonl"
        first, *rest = train.read_text().splitlines()
        row = json.loads(first)
        train.write_text("\n".join([json.dumps({**row, "answer": str((int(row["answer"]) + 1) % 10)}), *rest]) + "\n")
        code, out = train_here(capfd, path, resume=True)  # the command's own refusal, before any actor
        assert code == 2 and "the training data changed since it was written" in out, out[-2000:]
        assert "Generator" not in out
