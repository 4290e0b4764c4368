"""User-style reward functions that tests load by dotted path (``reward_fixtures.<name>``)."""

from __future__ import annotations

import string
import sys
import time
import zlib
from pathlib import Path
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


def inf_reward(prompt: str, completion: str, **_: Any) -> float:
    return float("inf")


def exiting_reward(prompt: str, completion: str, **_: Any) -> float:
    sys.exit(3)


def first_char_reward(prompt: str, completion: str, **_: Any) -> float:
    """(code of the first character mod 10) / 10: varies across a tiny random model's samples, so groups have
    non-zero advantages. Raises for an empty completion or one opening with punctuation: those stay unscored."""
    if not completion or completion[0] in string.punctuation:
        raise ValueError(f"cannot score {completion!r}")
    return (ord(completion[0]) % 10) / 10


def half_informative_reward(prompt: str, completion: str, **_: Any) -> float:
    """For the prompts whose CRC-32 is odd, (code of the first character mod 10) / 10 (0 for an empty completion);
    0 for the others: their groups' rewards are all equal, so dynamic sampling drops about half the groups."""
    if zlib.crc32(prompt.encode()) % 2 == 0 or not completion:
        return 0.0
    return (ord(completion[0]) % 10) / 10


def slow_once_asked(prompt: str, completion: str, signal_dir: str, delay_s: float = 0.5, **_: Any) -> float:
    """0.0 (give it weight 0 and the rewards are unchanged). Returns at once until the file `<signal_dir>/slow`
    exists; from then on it creates `<signal_dir>/scoring` and takes `delay_s` per completion, so that a test can
    act while a step's completions are being scored."""
    folder = Path(signal_dir)
    if (folder / "slow").exists():
        (folder / "scoring").touch()
        time.sleep(delay_s)
    return 0.0


def env_reward(prompt: str, completion: str, name: str, sha256: str, **_: Any) -> float:
    """1.0 when the environment variable `name` holds a value whose SHA-256 is `sha256` (the value itself never
    appears in a config), else 0.0: shows that a variable reached the reward workers."""
    import hashlib
    import os

    value = os.environ.get(name)
    return float(value is not None and hashlib.sha256(value.encode()).hexdigest() == sha256)
