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


# Rewards that misbehave the ways user code does; the sandbox scores each completion as failed, saying why.


def forking_reward(prompt: str, completion: str, **_: Any) -> float:
    """Starts a process that would outlive the call."""
    import subprocess

    subprocess.Popen(["sleep", "600"])
    return 1.0


def threading_reward(prompt: str, completion: str, **_: Any) -> float:
    """Starts a thread that would outlive the call."""
    import threading

    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    return 1.0


def sleeping_reward(prompt: str, completion: str, **_: Any) -> float:
    """Never returns."""
    while True:
        time.sleep(1)


def hungry_reward(prompt: str, completion: str, **_: Any) -> float:
    """Asks for far more memory than a reward needs (64 GiB)."""
    return float(len(bytearray(64 << 30)))


def networking_reward(prompt: str, completion: str, port: int = 0, **_: Any) -> float:
    """Connects to a local server (`port`, or one given in the environment)."""
    import os
    import socket

    with socket.create_connection(("127.0.0.1", port or int(os.environ["SANDBOX_TEST_PORT"])), timeout=2):
        return 1.0


def quitting_reward(prompt: str, completion: str, **_: Any) -> float:
    """Ends its process at once."""
    import os

    os._exit(3)


MISBEHAVIOURS = (forking_reward, threading_reward, sleeping_reward, hungry_reward, networking_reward, quitting_reward)


def misbehaving_reward(prompt: str, completion: str, state_dir: str, port: int, **fields: Any) -> float:
    """Misbehaves each of the ways above once in a run (the first call to claim a way does it, across every reward
    worker: `state_dir` holds the claims), then scores as `length_reward`."""
    import os

    for index, misbehave in enumerate(MISBEHAVIOURS):
        try:
            os.close(os.open(os.path.join(state_dir, str(index)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        return misbehave(prompt, completion, port=port)
    return length_reward(prompt, completion)
