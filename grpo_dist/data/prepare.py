"""`grpo-dist prepare LAYOUT SOURCE OUT.jsonl`: the public datasets the recipes train and evaluate on, rewritten as
the rows a run reads, each row's answer the one its reward compares with (not a worked solution).

- gsm8k (openai/gsm8k, subset main: `question`, `answer` = worked solution ending in `#### 72`): the answer is what
  follows `####`, without thousands separators.
- math (MATH, as DigitalLearningGmbH/MATH-lighteval, and MATH-500: `problem`, `solution` with the result in
  `\\boxed{...}`): the last boxed expression.
- dapo-math (DAPO-Math-17k: `prompt` = chat turns, `reward_model.ground_truth`): the user's turn and the ground
  truth; the hub copy repeats every problem many times, and each is written once.
- aime (AIME 2024 and 2025: `problem`, `answer`): the problem and its integer answer.
- mbpp (MBPP, subsets full and sanitized: a description (`text`, `prompt`), `code`, `test_list`, setup code or
  imports): a prompt that names the tests, `tests` for the `code_tests` reward (each with the setup before it),
  and the reference code as the answer, which the pre-flight check scores with `eval.reward: code_tests`.
- geo3k (Geometry3K, as hiyouga/geometry3k: `images` (its diagram), `problem` (led by an `<image>` placeholder),
  `answer`): the problem without its placeholder (the chat template places the image), the answer, and the image,
  written as a PNG file in `OUT-images/` beside OUT (the row names it relative to OUT's folder).

SOURCE is any layout `data.path` takes (a file, a `save_to_disk` directory, a hub id with --split, --subset and
--revision). A row the layout cannot read is named with what it lacks, and nothing is written.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_dist.config.sections import FieldsConfig
from grpo_dist.data.dataset import DatasetError
from grpo_dist.data.sources import read_source


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


Row = dict[str, Any]


def _gsm8k(row: Row) -> Row | str:
    answer = gsm8k_answer(str(row["answer"]))
    if answer is None:
        return "no final answer (a `####` line) in its 'answer' column"
    return {"prompt": row["prompt"], "answer": answer, "solution": row["answer"]}


def _math(row: Row) -> Row | str:
    answer = last_boxed(str(row["answer"]))
    if answer is None:
        return "no final answer (a \\boxed{...}) in its 'solution' column"
    return {"prompt": row["prompt"], "answer": answer, "solution": row["answer"]}


def _dapo_math(row: Row) -> Row | str:
    users = [turn["content"] for turn in row["messages"] if turn["role"] == "user"]
    if not users or not str(row["answer"]).strip():
        return "no user turn in 'prompt'" if not users else "an empty 'reward_model.ground_truth'"
    return {"prompt": users[-1], "answer": str(row["answer"]).strip()}


def _aime(row: Row) -> Row | str:
    answer = str(row["answer"]).strip()
    return {"prompt": row["prompt"], "answer": answer} if answer else "an empty 'answer'"


def _mbpp(row: Row) -> Row | str:
    tests, code = row.get("test_list"), row.get("code")
    if not isinstance(tests, list) or not tests or not code:
        return f"no 'code' and 'test_list' (it has {sorted(row)})"
    setup = row.get("test_setup_code") or "\n".join(row.get("test_imports") or [])
    listed = "\n".join(tests)
    return {
        "prompt": f"{row['prompt']}\nYour code should pass these tests:\n{listed}\nAnswer with the code in a "
        "```python block.",
        "answer": f"```python\n{code}\n```",
        "tests": [f"{setup}\n{test}" if setup.strip() else test for test in tests],
    }


def _geo3k(row: Row) -> Row | str:
    problem = str(row["prompt"]).replace("<image>", "").strip()
    if not row.get("images") or not problem:
        return "no image in 'images'" if not row.get("images") else "an empty 'problem'"
    return {"prompt": problem, "answer": str(row["answer"]).strip(), "images": row["images"]}


@dataclass(frozen=True)
class Layout:
    """A public dataset's layout: where it lives, the columns read as prompt and answer, and the row it becomes."""

    source: str  # its hub id (the recipes' SOURCE), with `subset` and `split`
    subset: str | None
    split: str
    fields: FieldsConfig
    convert: Callable[[Row], Row | str]  # the row written, or why the row cannot be read
    unique: bool = False  # write each prompt once
    subset_fields: dict[str, FieldsConfig] | None = None  # a subset whose columns differ

    def fields_of(self, subset: str | None) -> FieldsConfig:
        return (self.subset_fields or {}).get(subset or "", self.fields)


LAYOUTS: dict[str, Layout] = {
    "gsm8k": Layout("openai/gsm8k", "main", "train", FieldsConfig(prompt="question", answer="answer"), _gsm8k),
    "math": Layout(
        "DigitalLearningGmbH/MATH-lighteval", None, "train", FieldsConfig(prompt="problem", answer="solution"), _math
    ),
    "dapo-math": Layout(
        "BytedTsinghua-SIA/DAPO-Math-17k",
        None,
        "train",
        FieldsConfig(messages="prompt", answer="reward_model.ground_truth"),
        _dapo_math,
        unique=True,
    ),
    "aime": Layout("HuggingFaceH4/aime_2024", None, "train", FieldsConfig(prompt="problem", answer="answer"), _aime),
    "mbpp": Layout(
        "google-research-datasets/mbpp",
        "full",
        "train",
        FieldsConfig(prompt="text", answer=None),
        _mbpp,
        subset_fields={"sanitized": FieldsConfig(prompt="prompt", answer=None)},
    ),
    "geo3k": Layout(
        "hiyouga/geometry3k", None, "train", FieldsConfig(prompt="problem", answer="answer", images="images"), _geo3k
    ),
}


def prepare(
    layout: str,
    source: str,
    out: str | Path,
    split: str | None = None,
    subset: str | None = None,
    revision: str | None = None,
) -> tuple[Path, int]:
    """Write `out` (JSON Lines) from the `layout` dataset at `source`; returns it and how many repeated prompts were
    left out. `split` and `subset` default to the layout's own (openai/gsm8k: main, train)."""
    chosen = LAYOUTS[layout]
    hub = source == chosen.source
    subset = subset if subset is not None else (chosen.subset if hub else None)
    rows = read_source(source, split or chosen.split, subset, chosen.fields_of(subset), "SOURCE", revision)
    prepared: list[Row] = []
    seen: set[str] = set()
    for number, row in enumerate(rows, start=1):
        converted = chosen.convert(row)
        if isinstance(converted, str):
            raise DatasetError(f"{source}: row {number}: {converted}")
        if chosen.unique and converted["prompt"] in seen:
            continue
        seen.add(converted["prompt"])
        prepared.append(converted)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pictures = out.with_name(f"{out.stem}-images")
    for number, row in enumerate(prepared):
        if "images" in row:  # PNG bytes (`grpo_dist.data.sources`), written beside OUT and named by their path
            row["images"] = [_written(image, pictures / f"{number}-{at}.png") for at, image in enumerate(row["images"])]
    partial = out.with_name(out.name + ".partial")
    partial.write_text("".join(json.dumps(row) + "\n" for row in prepared))
    partial.rename(out)
    return out, len(rows) - len(prepared)


def _written(image: bytes, path: Path) -> str:
    """`image` (PNG bytes) written to `path`; its path relative to its dataset file's folder (`path`'s parent's)."""
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(image)
    return str(path.relative_to(path.parent.parent))
