"""What a reward sandbox costs per call: the quick start's reward functions (`regex_format` and `math_answer`,
configs/quickstart.yaml: built-ins, called in the sandbox's server) and a user reward (`length_reward`, here: each
call in a fresh process forked for it) called through a reward sandbox, calls per second, side by side with the same
calls through the sandbox of another checkout (`--baseline`, e.g. one from before the fork server, whose sandbox
served every call in one long-lived process), in one run, and the ratio. Its last row is a reward worker's share:
`--calls` completions scored by both quick start functions as the checkout's reward worker scores them (completions a
second).

    .venv/bin/python benchmarks/sandbox_calls.py [--calls 200] [--baseline /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

QUICKSTART = [("regex_format", {"pattern": "[0-9]"}), ("math_answer", {})]  # configs/quickstart.yaml
USER = [("sandbox_calls.length_reward", {})]  # a user reward: each call in a fresh process
PROMPT, ANSWER = "7 3 9 5:", "5"
COMPLETIONS = ["5", "3", " 5 ", "55", "", "the answer is 5"]


def length_reward(prompt: str, completion: str, **_) -> float:
    """A user reward as small as they come: what a call costs beyond the function."""
    return min(1.0, len(completion) / 10)


def calls_per_s(calls: int) -> dict[str, float]:
    """Calls per second of each quick start function through one sandbox (`calls` calls each, after one warm-up),
    in the checkout this process imports `grpo_dist` from."""
    from grpo_dist.sandbox import Limits, Sandbox

    functions = QUICKSTART + USER
    sandbox = Sandbox([name for name, _ in functions], Limits(memory_mb=4096, cpu_s=10.0, processes=False,
                                                              network=False))  # fmt: skip
    found = {}
    try:
        for index, (name, kwargs) in enumerate(functions):
            kwargs = {**kwargs, "answer": ANSWER}
            sandbox.call(index, PROMPT, "5", kwargs, 60.0)
            started = time.perf_counter()
            for number in range(calls):
                score, error = sandbox.call(index, PROMPT, COMPLETIONS[number % len(COMPLETIONS)], kwargs, 60.0)
                assert error is None, error
            found[name] = calls / (time.perf_counter() - started)
    finally:
        sandbox.close()
    return found | {"a worker's share": share_per_s(calls)}


def share_per_s(completions: int) -> float:
    """Completions per second scored by the quick start's two functions through a `RewardRunner` as this checkout's
    reward worker scores a share of `completions` (all at once with `score_each` where the checkout has it, else one
    completion after the other), after one warm-up share."""
    from grpo_dist.config import RewardConfig, RewardFunctionConfig
    from grpo_dist.rewards.runner import RewardRunner

    specs = [RewardFunctionConfig(name=name, kwargs=kwargs) for name, kwargs in QUICKSTART]
    runner = RewardRunner([name for name, _ in QUICKSTART], RewardConfig(functions=specs, timeout_s=60.0))
    functions, weights, kwargs = list(range(len(specs))), [1.0] * len(specs), [dict(spec.kwargs) for spec in specs]
    share = [(PROMPT, COMPLETIONS[number % len(COMPLETIONS)], {"answer": ANSWER}) for number in range(completions)]

    def score_share() -> list:
        if hasattr(runner, "score_each"):
            return list(runner.score_each(functions, weights, kwargs, share))
        return [runner.score(functions, weights, kwargs, *each) for each in share]

    try:
        score_share()
        started = time.perf_counter()
        scores = score_share()
        assert all(error is None for _, _, errors in scores for error in errors), scores
        return completions / (time.perf_counter() - started)
    finally:
        runner.close()


def measured_in(checkout: str, calls: int) -> dict[str, float]:
    """`calls_per_s` in a process importing `grpo_dist` from `checkout`."""
    script = f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import sandbox_calls; " \
             f"print(json.dumps(sandbox_calls.calls_per_s({calls})))"  # fmt: skip
    env = {**os.environ, "PYTHONPATH": checkout}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=checkout, capture_output=True, text=True,
                          check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls timed per function")
    parser.add_argument("--baseline", help="another checkout of grpo-dist, measured the same way beside this one")
    args = parser.parse_args()
    here = str(Path(__file__).resolve().parent.parent)
    this = measured_in(here, args.calls)
    other = measured_in(args.baseline, args.calls) if args.baseline else None
    print(f"{'function':<34}{'this checkout':>16}" + (f"{'baseline':>12}{'ratio':>8}" if other else ""))
    for name, rate in this.items():
        row = f"{name:<34}{rate:>12.1f}/s"
        if other:
            row += f"{other[name]:>10.1f}/s{rate / other[name]:>8.2f}"
        print(row)


if __name__ == "__main__":
    main()
