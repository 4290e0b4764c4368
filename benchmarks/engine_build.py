"""What building a generator's vLLM engine costs in a process forked from a warm process, side by side with another
checkout.

    .venv/bin/python benchmarks/engine_build.py [--repeat 5] [--baseline DIR]

A generator forked from a warm process (`grpo_dist.cluster.warm`) builds its engine after the fork: vLLM's arguments and
config, then its engine core (forked from the generator on a CPU), which loads the model and sets up its worker. For
each checkout (this one, and `--baseline DIR`, another checkout of the repository, e.g. `git worktree add /tmp/base
<commit>`), a new interpreter with that checkout's code first on the path prepares a parent as its warm process does
(`warm.import_all`, the heap frozen), imports Ray and the generator's module as a forked generator does, and forks
`--repeat` children. Each child builds the engine in its own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: the
generator's work and its engine core's in one process, the quick start's settings on its tiny model, built once here)
and samples a greedy completion, reporting the CPU seconds and wall seconds of the build and the completion. Prints one
JSON line per checkout (the medians), a line saying whether every completion was the same, and, with a baseline, a
`ratios` line (this over the baseline). Run it on an otherwise idle machine; CI never runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPT = "3 : 4 :"


def parent(model: str, repeat: int) -> None:
    """In a new interpreter: prepared as the checkout's warm process is, fork the children that build the engine."""
    import gc
    import time

    from grpo_dist.cluster import warm

    warm.import_all()
    gc.freeze()
    import ray  # noqa: F401 - what a forked generator imports before its engine

    import grpo_dist.cluster.actors.generator  # noqa: F401

    for _ in range(repeat):
        read_end, write_end = os.pipe()
        if (pid := os.fork()) == 0:
            os.environ.update(TORCHDYNAMO_DISABLE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="ERROR")
            from vllm import LLM, SamplingParams

            cpu, wall = time.process_time(), time.perf_counter()
            engine = LLM(model=model, dtype="float32", max_model_len=64, enforce_eager=True,
                         kv_cache_memory_bytes=64 << 20, enable_chunked_prefill=False, seed=0)  # fmt: skip
            built = {"build_cpu_s": time.process_time() - cpu, "build_wall_s": time.perf_counter() - wall}
            [output] = engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
            os.write(write_end, json.dumps({**built, "completion": output.outputs[0].text}).encode())
            os._exit(0)
        os.close(write_end)
        os.waitpid(pid, 0)
        print(os.read(read_end, 4096).decode(), flush=True)
        os.close(read_end)


def measure(checkout: Path, model: str, repeat: int) -> list[dict]:
    command = [sys.executable, str(Path(__file__).resolve()), "--repeat", str(repeat), "--parent", model]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"the parent in {checkout} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if len(rows) != repeat:
        raise SystemExit(f"{checkout}: {len(rows)} of {repeat} children answered:\n{done.stderr[-3000:]}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--baseline", type=Path, help="another checkout of the repository, measured first")
    parser.add_argument("--parent", help=argparse.SUPPRESS)  # the model a child interpreter builds engines of
    args = parser.parse_args()
    if args.parent is not None:
        parent(args.parent, args.repeat)
        return
    if args.baseline is not None and not (args.baseline / "grpo_dist" / "cluster" / "warm.py").is_file():
        raise SystemExit(f"--baseline {args.baseline}: not a checkout of grpo-dist (no grpo_dist/cluster/warm.py)")
    sys.path.insert(0, str(REPO))
    from grpo_dist.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as scratch:
        model = str(build_tiny_model(Path(scratch) / "model", characters="0123456789 :"))  # the quick start's
        checkouts = {"baseline": args.baseline.resolve()} if args.baseline is not None else {}
        checkouts["this"] = REPO
        medians, completions = {}, set()
        for name, checkout in checkouts.items():
            rows = measure(checkout, model, args.repeat)
            completions.update(row["completion"] for row in rows)
            medians[name] = {key: round(statistics.median(row[key] for row in rows), 3)
                             for key in ("build_cpu_s", "build_wall_s")}  # fmt: skip
            print(json.dumps({"checkout": name, "repeat": args.repeat, **medians[name]}), flush=True)
    print(json.dumps({"same_completion_everywhere": len(completions) == 1, "completions": sorted(completions)}))
    if "baseline" in medians:
        ratios = {key: round(medians["this"][key] / medians["baseline"][key], 3) for key in medians["this"]}
        print(json.dumps({"row": "ratios", "this_over_baseline": ratios}))


if __name__ == "__main__":
    main()
