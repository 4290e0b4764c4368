"""What a process forked from a warm process still imports itself, with and without the warm process's later imports.

    .venv/bin/python benchmarks/fork_imports.py [--repeat 3]

A warm process (`grpo_dist.cluster.warm`) imports the stack, then what each actor and forked driver imports first
(`FIRST_IMPORTS`) and what a generator's engine core imports as it starts on a CPU (`ENGINE_IMPORTS`, with
torch.compile off). For each way of preparing a parent (the stack alone, as before those two lists; and all three as
the warm process does now) a new interpreter prepares it as the warm process does (Ray kept out, the heap frozen),
then forks `--repeat` children per target, each of which imports what that target needs and reports the CPU seconds
it took: an actor's module with Ray (the learner's, the generator's, the reward worker's), or the engine's modules
(which its engine core imports, forked from its generator).
Prints one JSON line per way and target (the median of the repeats) and a `ratios` line (now over before). Run it
on an otherwise idle machine; CI never runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ACTORS = {
    "learner": ["grpo_dist.cluster.actors.learner"],
    "generator": ["grpo_dist.cluster.actors.generator"],
    "reward worker": ["grpo_dist.cluster.actors.reward_worker"],
}
WAYS = {"the stack alone": ("STACK",), "the warm process's imports": ("STACK", "FIRST_IMPORTS", "ENGINE_IMPORTS")}


def parent(lists: list[str], repeat: int) -> None:
    """In a new interpreter: import `lists` of `grpo_dist.cluster.warm` as it does, then fork the children."""
    import gc
    import time

    from grpo_dist.cluster import warm

    warm.import_all(tuple(lists))
    gc.freeze()
    targets = {**ACTORS, "engine": list(warm.ENGINE_IMPORTS)}
    for target, modules in targets.items():
        for _ in range(repeat):
            read_end, write_end = os.pipe()
            if (pid := os.fork()) == 0:
                if target == "engine":
                    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # as an eager engine's process has it
                started = time.process_time()
                if target != "engine":  # the engine core is forked from its generator, which has imported Ray
                    import ray._private.workers.default_worker  # noqa: F401 - what a Ray worker runs

                for module in modules:
                    __import__(module)
                os.write(write_end, f"{time.process_time() - started:.4f}".encode())
                os._exit(0)
            os.close(write_end)
            os.waitpid(pid, 0)
            print(json.dumps({"target": target, "cpu_s": float(os.read(read_end, 64))}), flush=True)
            os.close(read_end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--parent", help=argparse.SUPPRESS)  # the lists a child interpreter imports
    args = parser.parse_args()
    if args.parent is not None:
        parent(args.parent.split(","), args.repeat)
        return
    found = {}
    for way, lists in WAYS.items():
        command = [sys.executable, __file__, "--repeat", str(args.repeat), "--parent", ",".join(lists)]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise SystemExit(f"the parent ({way}) failed:\n{done.stderr[-3000:]}")
        rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        for target in [*ACTORS, "engine"]:
            median = statistics.median(row["cpu_s"] for row in rows if row["target"] == target)
            found[(way, target)] = median
            print(json.dumps({"way": way, "target": target, "cpu_s_median": round(median, 3)}))
    before, now = WAYS
    ratios = {target: round(found[(now, target)] / found[(before, target)], 3) for target in [*ACTORS, "engine"]}
    print(json.dumps({"row": "ratios", "now_over_before": ratios}))


if __name__ == "__main__":
    main()
