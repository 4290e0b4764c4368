"""`grpo-dist status RUN_DIR`: where a run stands, read from the files it writes (no Ray, nothing started): its step
and pace, the last step's figures, its generators, the divergence guard's and the fault counts, its last events
(`events.jsonl`: health events, faults, changes of the generator count, the W&B run, the end) and its W&B page. A
run prints the same summary as its last lines when it ends. `status_from_logs` reads a submitted job's console the
same way."""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

import yaml

from grpo_dist.storage import control, jsonl

EVENTS = "events.jsonl"
SHOWN_EVENTS = 5
SHOWN_KINDS = ("health", "fault", "autoscale", "scale")
PACE_STEPS = 10  # the steps the pace and ETA are measured over
HEALTH_COUNTS = {"warnings": "warnings", "skipped": "updates skipped", "rollbacks": "rollbacks"}


STALLS = "stalls"
"""The run directory's folder of stalled actors' stacks (`grpo_dist.faults.stacks.STALLS_DIR`)."""


def summary(run_dir: Path, ended: bool = False, shown: str | None = None) -> list[str]:
    """The lines `grpo-dist status` prints for the run in `run_dir` (`ended`: printed by the run itself as it ends,
    its state read from its last event rather than from its lock; `shown`: where the run is, for its first line,
    when that is not `run_dir`: an object store's URI)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir}: not a run directory (it has no config.yaml)")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    steps = config["run"]["steps"]
    rows, events = _rows(run_dir / "metrics.jsonl"), _rows(run_dir / EVENTS)
    step = rows[-1]["step"] if rows else 0
    state = _state(run_dir, events, ended)
    pace = _pace(rows, steps, eta=state == "running")
    lines = [f"run {config['run']['name']} ({shown or run_dir}): {state}, step {step}/{steps}{pace}"]
    if rows:
        last = rows[-1]
        figures = [
            f"{key.split('/')[0]} {last[key]:.4g}" for key in ("reward/mean", "loss", "kl") if _number(last, key)
        ]
        lines.append(f"  last step: {', '.join(figures)}, {last.get('time/step', 0.0):.1f} s")
        lines.append(f"  generators: {_generators(last)}")
        health = [f"{int(last.get(f'health/{key}', 0))} {name}" for key, name in HEALTH_COUNTS.items()]
        lines.append(f"  health: {', '.join(health)}")
        faults = [f"{key.removeprefix('faults/')} {value:g}" for key, value in last.items()
                  if key.startswith("faults/") and _number(last, key) and value]  # fmt: skip
        lines.append(f"  faults: {', '.join(faults) or 'none'}")
    dumps = sorted((run_dir / STALLS).glob("*.txt")) if (run_dir / STALLS).is_dir() else []
    if dumps:
        latest = max(dumps, key=lambda path: path.stat().st_mtime)
        lines.append(f"  stalls: {len(dumps)} stack dump(s) of actors a wait gave up on, the latest {latest}")
    happened = [event for event in events if event["kind"] in SHOWN_KINDS]
    if happened:
        lines.append(f"  last events ({min(len(happened), SHOWN_EVENTS)} of {len(happened)}):")
        lines += [
            f"    {_clock(event['time'])} step {event['step']}: {event['message']}"
            for event in happened[-SHOWN_EVENTS:]
        ]
    wandb = [event["message"] for event in events if event["kind"] == "wandb"]
    lines.append(f"  W&B: {wandb[-1] if wandb else 'off'}")
    return lines


def _rows(path: Path) -> list[dict]:
    return jsonl.read_rows(path) if path.is_file() else []


def _number(row: dict, key: str) -> bool:
    return isinstance(row.get(key), int | float)


def _state(run_dir: Path, events: list[dict], ended: bool) -> str:
    """running (a process holds the run's lock), finished, stopped (and why), or not running."""
    if not ended and control.is_running(run_dir):
        return "running"
    ends = [event for event in events if event["kind"] == "end"]
    return ends[-1]["message"] if ends else "not running"


def _pace(rows: list[dict], steps: int, eta: bool) -> str:
    """`, 0.45 steps/s ..., about 2m 13s to go` (with `eta`), over the last steps' lengths."""
    lengths = [row["time/step"] for row in rows[-PACE_STEPS:] if _number(row, "time/step")]
    if not lengths:
        return ""
    per_step = statistics.mean(lengths)
    left = steps - rows[-1]["step"]
    to_go = f", about {_duration(left * per_step)} to go" if eta and left > 0 else ""
    return f", {1 / per_step:.3g} steps/s over the last {len(lengths)} (training time){to_go}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


def _generators(row: dict) -> str:
    count, joining = int(row.get("generators/count", 0)), int(row.get("generators/joining", 0))
    speed = row.get("throughput/generated_tokens_per_s")
    return f"{count}" + (f" ({joining} joining)" if joining else "") + (f", {speed:,.0f} tokens/s" if speed else "")


def _clock(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def status_from_logs(job_id: str, state: str, logs: str) -> list[str]:
    """A submitted job's status from its console: the summary it printed on ending, or (while it runs) its job
    state, its last step line, its last health events and faults and its W&B line."""
    lines = logs.splitlines()
    starts = [index for index, line in enumerate(lines) if re.match(r"run \S+ \(.*\): ", line)]
    if starts:
        return [f"job {job_id}: {state}", *lines[starts[-1] :]]
    steps = [line for line in lines if re.match(r"step +\d+/\d+ ", line)]
    events = [line for line in lines if line.startswith(("health: ", "fault: "))][-SHOWN_EVENTS:]
    wandb = [line for line in lines if line.startswith("W&B run")]
    found = [f"  last step: {steps[-1]}" if steps else "  no step finished yet"]
    found += [f"  {line}" for line in events] + [f"  {wandb[-1]}" if wandb else "  W&B: off"]
    return [f"job {job_id}: {state}", *found]
