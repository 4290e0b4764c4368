"""User-style reward functions that tests load by dotted path (``reward_fixtures.<name>``)."""

from __future__ import annotations

import time
from typing import Any

NOT_CALLABLE = 3


def length_reward(prompt: str, completion: str, scale: float = 1.0, **_: Any) -> float:
    """``scale * len(completion)``: a user reward with its own keyword argument."""
    return scale * len(completion)


def raising_reward(prompt: str, completion: str, **_: Any) -> float:
    raise RuntimeError("reward server unreachable")


def slow_reward(prompt: str, completion: str, delay_s: float = 2.0, **_: Any) -> float:
    time.sleep(delay_s)
    return 1.0


def string_reward(prompt: str, completion: str, **_: Any) -> str:
    return "1.0"


def nan_reward(prompt: str, completion: str, **_: Any) -> float:
    return float("nan")


def flaky_length_reward(prompt: str, completion: str, **_: Any) -> float:
    """Length of the completion over 4, but raises for lengths divisible by 3: some completions stay unscored."""
    if len(completion) % 3 == 0:
        raise ValueError(f"cannot score a completion of length {len(completion)}")
    return len(completion) / 4
