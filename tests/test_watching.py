"""Watching a run, asserted from the files it writes: the quick start (its eval sets: the held-out prompts greedy,
and sampled k = 4 times) evaluating every 2 steps, W&B offline; then resumed from an earlier checkpoint; then its
final policy evaluated on its own by `grpo-dist eval`; then drawn by `grpo-dist plot`. The console before step 1
fits on one screen, the actors' and libraries' output going to verbose.log."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import yaml
from conftest import REPO, TESTS_DIR, cli_here, small_config
from test_resume import grpo_dist, rows
from transformers import AutoModelForCausalLM
from wandb_files import history, records, table

from grpo_dist.algo.throughput import flop_params

pytestmark = pytest.mark.slow

SCREEN = 40  # lines: what a terminal shows at once


def run(*args: str) -> str:
    process = grpo_dist(*args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = process.communicate(timeout=900)
    assert process.returncode == 0, out[-4000:]
    return out


def grpo_dist_python(script: str, *args: str) -> subprocess.Popen:
    """A Python process running `script` with grpo-dist importable and the tests' reward functions found."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-c", script, *args]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_run_seen_through_its_files_console_wandb_eval_and_plot(capfd, tmp_path):
    config = str(REPO / "configs" / "quickstart.yaml")
    settings = [
        f"run.output_dir={tmp_path / 'outputs'}", f"model.path={tmp_path / 'model'}", "run.steps=4",
        "data.prompts_per_step=8", "data.task.num_train=200", "data.task.num_eval=16",
        "eval.every=2", "eval.max_prompts=16", "checkpoint.every_steps=3",
        "wandb.mode=offline", "wandb.table_every=2", "wandb.table_rows=20", "wandb.group=watching",
        "wandb.tags=[smoke]",
    ]  # fmt: skip
    out = run("train", config, *settings)
    run_dir = tmp_path / "outputs" / "quickstart"

    # The console: sections and one line per step; before step 1, one screen; no actor output on it.
    lines = out.splitlines()
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1/4"))
    assert first_step <= SCREEN, "\n".join(lines[:first_step])
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["1/4", "2/4", "3/4", "4/4"]
    assert not [line for line in lines if "pid=" in line]  # Ray prefixes what an actor prints with its pid
    assert "pid=" in (run_dir / "verbose.log").read_text()  # ... and it went to the log file

    # Evaluation: before training (step 0), every 2 steps; pass@j recomputed from the judged samples by hand.
    evaluations = jsonl(run_dir / "eval.jsonl")
    assert [row["step"] for row in evaluations] == [0, 2, 4]
    for row in evaluations:
        samples = jsonl(run_dir / "eval_samples" / f"step-{row['step']:06d}.jsonl")
        correct = defaultdict(list)
        for each in samples:
            correct[(each["set"], each["prompt_index"])].append(each["correct"])
        greedy = [c for (name, _), c in correct.items() if name == "held_out"]
        sampled = [c for (name, _), c in correct.items() if name == "sampled"]
        assert (
            len(greedy) == len(sampled) == 16 and {len(c) for c in greedy} == {1} and {len(c) for c in sampled} == {4}
        )
        assert row["eval/held_out/accuracy"] == pytest.approx(sum(c[0] for c in greedy) / 16)
        for j in range(1, 5):
            by_hand = sum(1 - math.comb(4 - sum(c), j) / math.comb(4, j) for c in sampled) / 16
            assert row[f"eval/sampled/pass@{j}"] == pytest.approx(by_hand)
        assert 0 <= row["eval/sampled/maj@4"] <= 1 and "eval/held_out/maj@1" not in row
        assert row["time/eval"] > 0
    learned = [row["eval/sampled/accuracy"] for row in evaluations]
    assert len(set(learned)) > 1  # the policy moved between evaluations: the numbers are its own

    # metrics.jsonl: a row per step (an evaluation has its own, above); throughput, memory and engine statistics.
    steps = rows(run_dir)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    n, layers, hidden, longest = flop_params(model), model.config.num_hidden_layers, model.config.hidden_size, 34
    assert [row["step"] for row in steps] == [1, 2, 3, 4]
    assert not [key for row in steps for key in row if key.startswith("eval/") or key == "time/eval"]
    for row in steps:
        assert row["tokens/trained"] > row["tokens/generated"] > 0  # the prompts are trained on too
        assert row["throughput/generated_tokens_per_s"] > 0 and row["throughput/trained_tokens_per_s"] > 0
        assert row["throughput/learner_flops_per_s"] > 0 and "throughput/mfu" not in row  # a CPU: no peak known
        # one training pass (no reference: kl_coef 0): 6 N a token, plus attention, over sequences of <= 34 tokens
        tokens = row["tokens/trained"]
        assert 6 * n * tokens <= row["learner/flops"] <= tokens * (6 * n + 6 * layers * hidden * longest)
        assert row["memory/learner_gb"] > 0.1 and row["memory/engine_gb"] > 0.1
        assert row["engine/running_max"] >= 1 and 0 < row["engine/kv_cache_usage_max"] <= 1

    # The completion table: at step 1 and every 2 steps, one whole group (16 rows, capped at 20).
    table_rows = jsonl(run_dir / "completions.jsonl")
    assert sorted({row["step"] for row in table_rows}) == [1, 2, 4]
    assert [sum(row["step"] == step for row in table_rows) for step in (1, 2, 4)] == [16, 16, 16]
    columns = {"prompt", "completion", "reward", "reward/regex_format", "reward/math_answer", "advantage",
               "staleness", "generator"}  # fmt: skip
    assert columns <= set(table_rows[0]) and table_rows[0]["generator"] == 0 and table_rows[0]["staleness"] == 0

    # W&B (offline): every row against the training step, the run's group and tags, histograms, the table.
    (session,) = (run_dir / "wandb").glob("offline-run-*")
    logged = history(session)
    assert [row["train/step"] for row in logged] == [0, 1, 2, 2, 3, 4, 4]  # each step, then its evaluation
    evaluated = [row for row in logged if "eval/sampled/pass@4" in row]
    assert [row["train/step"] for row in evaluated] == [0, 2, 4]
    assert [row["eval/sampled/pass@4"] for row in evaluated] == [row["eval/sampled/pass@4"] for row in evaluations]
    trained = [row for row in logged if "reward/mean" in row]
    assert [row["train/step"] for row in trained] == [1, 2, 3, 4]
    assert all(row["histograms/rewards/_type"] == "histogram" for row in trained)
    logged_table = table(session, trained[1], "completions")  # step 2
    assert len(logged_table["data"]) == 16 and "advantage" in logged_table["columns"]
    (started,) = [r.run for r in records(next(session.glob("run-*.wandb"))) if r.WhichOneof("record_type") == "run"]
    assert (started.run_group, list(started.tags)) == ("watching", ["smoke"])
    run_id = started.run_id

    # Resumed from the step-3 checkpoint to step 5: step 4 is done again; W&B continues the same run and shows it.
    out = run("train", config, *settings[:2], "run.steps=5", *settings[3:], "--resume",
              str(run_dir / "checkpoints" / "step-000003"))  # fmt: skip
    assert f"W&B run (continued) {run_id}, offline" in out
    assert [row["step"] for row in rows(run_dir)] == [1, 2, 3, 4, 5]
    assert [row["step"] for row in jsonl(run_dir / "eval.jsonl")] == [0, 2, 4, 5]
    (again,) = [s for s in (run_dir / "wandb").glob("offline-run-*") if s != session]
    assert again.name.endswith(run_id)
    assert [row["train/step"] for row in history(again)] == [4, 4, 5, 5]  # the redone step 4 is there

    # The final policy evaluated on its own: the same greedy answers as the run's evaluation after training.
    out = run("eval", config, *settings, "--checkpoint", str(run_dir / "final"), "--out", str(tmp_path / "e.json"))
    standalone = json.loads((tmp_path / "e.json").read_text())
    after = jsonl(run_dir / "eval.jsonl")[-1]
    assert standalone["eval/held_out/accuracy"] == after["eval/held_out/accuracy"]
    assert f"eval held_out of {run_dir / 'final'}: accuracy" in out
    assert not [line for line in out.splitlines() if "pid=" in line or "WARNING" in line], out  # as train's console
    (log,) = re.findall(r"the libraries' and actors' output: (\S+verbose.log)", out)
    assert "pid=" in Path(log).read_text()  # ... and it went to eval's own log file, kept

    plotted = cli_here(capfd, "plot", str(run_dir / "metrics.jsonl"), str(tmp_path / "run.png"))
    assert plotted.returncode == 0, plotted.stderr
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_whose_reader_left_trains_to_its_end_and_resuming_it_finds_it_finished(capfd, tmp_path):
    """`grpo-dist train CONFIG | head -2`: the console's reader is gone before the first step; the run is not
    touched by it: every step, its checkpoint and the final policy written, exit 0. Then the finished run submitted
    again (`--resume auto`, as `submit` does) says so and ends before any actor starts, its files as they were."""
    raw = small_config(tmp_path, run={"steps": 2}, checkpoint={"every_steps": 2})
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        process = grpo_dist("train", str(config), stdout=write_end, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write_end)
    _, err = process.communicate(timeout=900)
    assert process.returncode == 0, err[-3000:]
    run_dir = tmp_path / "outputs" / "test"
    assert [row["step"] for row in jsonl(run_dir / "metrics.jsonl")] == [1, 2]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-000002"
    assert (run_dir / "final" / "model.safetensors").is_file()

    before = {path: path.stat().st_mtime_ns for path in run_dir.rglob("*") if path.is_file()}
    resumed = cli_here(capfd, "train", str(config), "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    again = resumed.stdout + resumed.stderr
    assert "the run already finished at step 2 (run.steps 2): nothing to train" in again, again
    assert "started in" not in again and "training: steps" not in again  # no cluster, no loop
    assert {path: path.stat().st_mtime_ns for path in run_dir.rglob("*") if path.is_file()} == before


def test_train_runs_twice_in_one_process(tmp_path):
    """`train()` called again in the same Python process (a notebook cell run a second time): each call starts its
    own Ray and ends it, and both runs finish. Each forks its actors warm as the command's run does: the first from
    a warm process of its own (the one its environment names is not there, which it says), the second from the
    session's, named as the first's was."""
    from conftest import session_warm_process

    from grpo_dist.cluster import warm

    raw = small_config(tmp_path, run={"steps": 1})
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    missing, shared = tmp_path / "gone.sock", session_warm_process()
    script = (
        "import os, sys\n"
        "from grpo_dist.config import load_config\n"
        "from grpo_dist.run.driver import train\n"
        "for name, socket in (('first', sys.argv[2]), ('second', sys.argv[3])):\n"
        f"    os.environ[{warm.SHARED_ENV!r}] = socket\n"
        "    print('ran', train(load_config(sys.argv[1], [f'run.name={name}'])), flush=True)\n"
    )
    process = grpo_dist_python(script, str(config), str(missing), str(shared or missing))
    out, _ = process.communicate(timeout=900)
    assert process.returncode == 0, out[-4000:]
    for name in ("first", "second"):
        assert f"ran {tmp_path / 'outputs' / name}" in out
        assert [row["step"] for row in jsonl(tmp_path / "outputs" / name / "metrics.jsonl")] == [1]
    said = f"{warm.SHARED_ENV}={missing} names no socket of this user's: the run starts a warm process of its own"
    assert out.count(said) == (1 if shared else 0), out[-4000:]  # none where no process starts warm (`shared`)
