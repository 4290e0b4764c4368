"""Counts a built-in reward reports while it scores, in the reward worker's own process (`code_tests`, which the
worker calls itself: `config.MODEL_CODE_REWARDS`), to be logged with the step's metrics: the worker hands them back
with each share it scored (`take`), the reward pool sums them per step. A user reward runs in the sandbox process,
whose counts would not reach the worker: its figures belong in its score."""

from __future__ import annotations

import threading
from collections import Counter

NOTES = {
    "code_tests/in_process": "tests code_tests could not split into values the code's jail computes and a verdict "
    "reached in the reward worker: their verdict is the word of the process that ran the completion's code "
    "(docs/sandbox.md; `strict: true` in code_tests' kwargs refuses them)",
}
"""What each counter counts, said once on the console the first time it is not zero."""

_counts: Counter[str] = Counter()
_lock = threading.Lock()


def count(key: str, amount: int = 1) -> None:
    """Add `amount` to the counter `key` (a metric name, e.g. `code_tests/in_process`)."""
    if amount:
        with _lock:
            _counts[key] += amount


def take() -> dict[str, float]:
    """The counts since the last call, and start again from zero."""
    with _lock:
        taken = {key: float(value) for key, value in _counts.items()}
        _counts.clear()
    return taken
