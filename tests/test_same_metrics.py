"""benchmarks/same_metrics.py: two runs' metrics compared exactly, step by step."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from conftest import REPO


def write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def compare(tmp_path, first, second):
    script = REPO / "benchmarks" / "same_metrics.py"
    files = [write(tmp_path / "a.jsonl", first), write(tmp_path / "b.jsonl", second)]
    return subprocess.run([sys.executable, str(script), *files], capture_output=True, text=True, timeout=60)


def test_equal_runs_pass_and_timings_are_not_compared(tmp_path):
    run = [
        {"step": 1, "reward/mean": 0.25, "loss": -0.1, "time/step": 1.0},
        {"step": 2, "reward/mean": 0.5, "loss": 0.0},
    ]
    other = [dict(row, **{"time/step": 9.0}) for row in run]
    result = compare(tmp_path, run, other)
    assert result.returncode == 0, result.stdout
    assert "2 steps, 2 columns compared exactly: reward/mean, loss" in result.stdout


def test_one_value_off_in_the_last_bit_fails_naming_step_and_column(tmp_path):
    run = [{"step": 1, "reward/mean": 0.25, "loss": -0.1}, {"step": 2, "reward/mean": 0.5, "loss": 0.1}]
    other = [run[0], dict(run[1], loss=math.nextafter(0.1, 1.0))]  # 0.1 and the next float up
    result = compare(tmp_path, run, other)
    assert result.returncode == 1
    assert "step 2: loss: 0.1 against 0.10000000000000002" in result.stdout


def test_a_missing_step_fails(tmp_path):
    run = [{"step": 1, "loss": 0.0}, {"step": 2, "loss": 0.0}]
    result = compare(tmp_path, run, run[:1])
    assert result.returncode == 1 and "steps: 2 against 1" in result.stdout
