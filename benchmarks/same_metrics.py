"""Did two runs log the same numbers? Compares two `metrics.jsonl` files step by step, exactly (no tolerance).

    .venv/bin/python benchmarks/same_metrics.py A/metrics.jsonl B/metrics.jsonl [--prefixes reward,loss,...]

What a change that must keep behaviour bit for bit is checked with: train the quick start on the commit before and
on the commit after (a `git worktree` of the one before, the same model directory for both), then compare:

    git worktree add /tmp/before BASE
    (cd /tmp/before && PYTHONPATH=/tmp/before ../main/.venv/bin/grpo-dist train configs/quickstart.yaml \\
        run.steps=20 run.output_dir=/tmp/before-out model.path=/tmp/model wandb.enabled=false)
    .venv/bin/grpo-dist train configs/quickstart.yaml run.steps=20 run.output_dir=/tmp/after-out \\
        model.path=/tmp/model wandb.enabled=false
    .venv/bin/python benchmarks/same_metrics.py /tmp/before-out/quickstart/metrics.jsonl \\
        /tmp/after-out/quickstart/metrics.jsonl

(and the same with `rollout.max_staleness=1`). The columns compared are those of the first file whose names start
with one of the prefixes: what the run learned, not its timings. Prints the steps, the columns and every value that
differs; exits 0 when none does, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys

PREFIXES = ("reward", "advantage", "response_length", "loss", "kl", "grad_norm", "entropy", "ratio", "clip_fraction",
            "staleness", "rollout/", "weight_version", "is_weight")  # fmt: skip


def rows(path: str) -> list[dict]:
    with open(path) as lines:
        return [json.loads(line) for line in lines if line.strip()]


def differences(first: list[dict], second: list[dict], prefixes: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The columns compared, and one line per value that differs (or per step one run lacks)."""
    columns = [key for key in first[0] if key.startswith(prefixes)] if first else []
    found = [f"steps: {len(first)} against {len(second)}"] if len(first) != len(second) else []
    for want, have in zip(first, second, strict=False):  # a step one run lacks is counted above
        found += [f"step {want.get('step')}: {key}: {want.get(key)!r} against {have.get(key)!r}"
                  for key in columns if have.get(key) != want.get(key)]  # fmt: skip
    return columns, found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--prefixes", default=",".join(PREFIXES), help="comma-separated column-name prefixes")
    args = parser.parse_args(argv)
    first, second = rows(args.first), rows(args.second)
    columns, found = differences(first, second, tuple(args.prefixes.split(",")))
    print(f"{len(first)} steps, {len(columns)} columns compared exactly: {', '.join(columns)}")
    print("\n".join(found) if found else "every value equal")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
