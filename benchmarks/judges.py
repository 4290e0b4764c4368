"""Reward functions for the benchmarks (importable by reward workers when `benchmarks/` is on PYTHONPATH)."""

from __future__ import annotations

import time
from typing import Any

from grpo_dist.rewards.builtin import math_answer


def slow_math_answer(prompt: str, completion: str, answer: Any, delay_s: float = 0.2, **_: Any) -> float:
    """`math_answer` after waiting `delay_s`: an I/O-bound judge (a remote model, a sandbox) that holds no CPU."""
    time.sleep(delay_s)
    return math_answer(prompt, completion, answer)
