"""`grpo-dist status` on run directories and job consoles written by hand (no Ray): the state from the run's lock or
its last event, the pace and what is left, the counts and the last events."""

from __future__ import annotations

import json

import yaml

from grpo_dist.cli import main
from grpo_dist.storage import control
from grpo_dist.storage.status import status_from_logs, summary


def run_dir_with(tmp_path, rows: list[dict], events: list[dict], steps: int = 10):
    run_dir = tmp_path / "outputs" / "demo"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"run": {"name": "demo", "steps": steps}}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(event) + "\n" for event in events))
    return run_dir


ROWS = [
    {"step": step, "time/step": 2.0, "reward/mean": 0.5, "loss": 0.01, "generators/count": 3.0,
     "generators/joining": 1.0, "throughput/generated_tokens_per_s": 1234.0, "health/warnings": 1.0,
     "health/skipped": 0.0, "health/rollbacks": 0.0, "faults/generator_restarts": 2.0, "faults/rollbacks": 0.0}
    for step in range(1, 5)
]  # fmt: skip
EVENTS = [
    {"time": 0.0, "step": 0, "kind": "wandb", "message": "https://wandb.ai/team/project/runs/abc"},
    *({"time": 0.0, "step": step, "kind": "fault", "message": f"generator 0 died ({step})"} for step in range(1, 7)),
    {"time": 0.0, "step": 4, "kind": "health", "message": "entropy 0.01 ... (health.entropy): a warning"},
]


def test_a_running_run_shows_its_pace_what_is_left_its_counts_and_last_five_events(tmp_path):
    run_dir = run_dir_with(tmp_path, ROWS, EVENTS)
    running = control.Running(run_dir)  # the lock a training run holds
    try:
        lines = summary(run_dir)
    finally:
        running.close()
    # 4 steps of 2.0 s: 0.5 steps/s; 6 steps left at 2.0 s each: 12 s
    assert (
        lines[0]
        == f"run demo ({run_dir}): running, step 4/10, 0.5 steps/s over the last 4 (training time), about 12s to go"
    )
    assert lines[1:5] == [
        "  last step: reward 0.5, loss 0.01, 2.0 s",
        "  generators: 3 (1 joining), 1,234 tokens/s",
        "  health: 1 warnings, 0 updates skipped, 0 rollbacks",
        "  faults: generator_restarts 2",
    ]
    assert lines[5] == "  last events (5 of 7):"
    assert [line.split(": ", 1)[1] for line in lines[6:11]] == [
        "generator 0 died (3)", "generator 0 died (4)", "generator 0 died (5)", "generator 0 died (6)",
        "entropy 0.01 ... (health.entropy): a warning",
    ]  # fmt: skip
    assert lines[11] == "  W&B: https://wandb.ai/team/project/runs/abc"


def test_an_ended_run_shows_how_it_ended_and_no_time_to_go(tmp_path, capsys):
    stopped = {"time": 0.0, "step": 4, "kind": "end", "message": "stopped (learner rank 0 died)"}
    run_dir = run_dir_with(tmp_path, ROWS, [stopped])
    assert main(["status", str(run_dir)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    pace = "0.5 steps/s over the last 4 (training time)"
    assert first == f"run demo ({run_dir}): stopped (learner rank 0 died), step 4/10, {pace}"
    assert main(["status", str(tmp_path)]) == 2
    assert "not a run directory (it has no config.yaml)" in capsys.readouterr().err


def test_a_jobs_console_gives_its_summary_or_while_it_runs_its_last_step_and_events():
    ended = "step 2/2  reward 1.000\nrun demo (/runs/demo): finished, step 2/2\n  health: 0 warnings\n  W&B: off\n"
    assert status_from_logs("raysubmit_1", "SUCCEEDED", ended) == [
        "job raysubmit_1: SUCCEEDED", "run demo (/runs/demo): finished, step 2/2", "  health: 0 warnings", "  W&B: off"
    ]  # fmt: skip
    running = "W&B run abc, offline: /x\nstep  1/50  reward 0.1\nfault: generator 1 died\nstep  2/50  reward 0.2\n"
    assert status_from_logs("raysubmit_2", "RUNNING", running) == [
        "job raysubmit_2: RUNNING", "  last step: step  2/50  reward 0.2", "  fault: generator 1 died",
        "  W&B run abc, offline: /x",
    ]  # fmt: skip
