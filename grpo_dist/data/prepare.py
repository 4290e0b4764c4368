"""`grpo-dist prepare gsm8k|math SOURCE OUT.jsonl`: the two layouts people bring first, rewritten as prompt/answer
rows whose answer is the final answer the reward compares with, not the worked solution.

- GSM8K (`question`, `answer` = worked solution ending in `#### 72`): the answer is what follows `####`, without
  thousands separators.
- MATH (`problem`, `solution` with the result in `\\boxed{...}`): the answer is the last boxed expression.

SOURCE is any layout `data.path` takes (a file, a `save_to_disk` directory, a hub id with --split/--subset). A row
whose final answer cannot be found is named, and nothing is written.
"""

from __future__ import annotations

import json
from pathlib import Path

from grpo_dist.config_sections import FieldsConfig
from grpo_dist.data.dataset import DatasetError
from grpo_dist.data.sources import read_source

LAYOUTS = {"gsm8k": ("question", "answer"), "math": ("problem", "solution")}


def gsm8k_answer(solution: str) -> str | None:
    """`72` from a GSM8K solution ending in `#### 72` (`1,000` -> `1000`); None without a `####` line."""
    if "####" not in solution:
        return None
    return solution.rsplit("####", 1)[1].strip().replace(",", "") or None


def last_boxed(solution: str) -> str | None:
    """The contents of the last `\\boxed{...}` (or `\\fbox{...}`) of a solution, braces balanced; None without one."""
    start = max(solution.rfind("\\boxed{"), solution.rfind("\\fbox{"))
    if start < 0:
        return None
    opening = solution.index("{", start)
    depth = 0
    for position in range(opening, len(solution)):
        depth += {"{": 1, "}": -1}.get(solution[position], 0)
        if depth == 0:
            return solution[opening + 1 : position].strip() or None
    return None


EXTRACT = {"gsm8k": gsm8k_answer, "math": last_boxed}


def prepare(layout: str, source: str, out: str | Path, split: str = "train", subset: str | None = None) -> Path:
    """Write `out` (JSON Lines of {prompt, answer, solution}) from the `layout` dataset at `source`."""
    prompt, solution = LAYOUTS[layout]
    fields = FieldsConfig(prompt=prompt, answer=solution)
    rows = read_source(source, split, subset, fields, "SOURCE")
    prepared = []
    for number, row in enumerate(rows, start=1):
        answer = EXTRACT[layout](str(row["answer"]))
        if answer is None:
            found = "a `####` line" if layout == "gsm8k" else "a \\boxed{...}"
            raise DatasetError(f"{source}: row {number}: no final answer ({found}) in its {solution!r} column")
        prepared.append({"prompt": row["prompt"], "answer": answer, "solution": row["answer"]})
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text("".join(json.dumps(row) + "\n" for row in prepared))
    partial.rename(out)
    return out
