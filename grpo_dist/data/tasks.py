"""Bundled synthetic tasks that a tiny random-init model can learn with GRPO on a CPU in minutes.

Each task makes rows ``{"prompt": ..., "answer": ...}`` from a seeded RNG; the answer is graded with the
``exact_answer`` or ``math_answer`` reward. Prompts use only characters of the tiny model's tokenizer
(:data:`grpo_dist.models.tiny.CHARACTERS`).

- ``last_digit``: ``"7 3 9 5:"`` -> ``"5"`` (2 to 4 digits; 11,100 distinct prompts).
- ``add``: ``"3+4="`` -> ``"7"`` (single digits; only 100 distinct prompts, so train and eval sets overlap).
- ``add_multi``: ``"47+85="`` -> ``"132"`` (two numbers of 1 or 2 digits; 10,000 distinct prompts): hard enough
  that a model warmed up on solved examples knows the format but is often wrong.
- ``multiply``: ``"37*48="`` -> ``"1776"`` (two numbers of 2 digits; 8,100 distinct prompts), beyond what a tiny
  model computes; each row also holds a ``transcript``: the tool-use conversation that solves it with the
  ``calculator`` tool (a Hermes tool call, the tool's answer, the answer), and ``solved``: that transcript for
  half the rows, a direct answer for the others (solved examples, half of them worked out without a tool), what
  ``grpo-dist sft`` warms up on in ``configs/agent.yaml``.
- ``color``: ``"color:"`` and a 56 x 56 picture of a red, green or blue disc (its place, size and the grey behind it
  drawn at random) -> ``"1"``, ``"2"`` or ``"3"``: the answer is only in the picture, for a vision-language model.
  Each row's ``images`` holds its picture's path (a PNG in ``images/`` beside the JSON Lines file, relative to it).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DIGITS = "0123456789"


@dataclass(frozen=True)
class Task:
    """A synthetic task: how to draw one row, and how many distinct prompts it can produce."""

    name: str
    description: str
    make_row: Callable[[random.Random], dict]  # rng -> {"prompt": ..., "answer": ...}
    num_distinct_prompts: int
    key: Callable[[dict], str] = lambda row: row["prompt"]  # what tells two rows' prompts apart


def _last_digit_row(rng: random.Random) -> dict[str, str]:
    digits = rng.choices(DIGITS, k=rng.randint(2, 4))
    return {"prompt": " ".join(digits) + ":", "answer": digits[-1]}


def _add_row(rng: random.Random) -> dict[str, str]:
    left, right = rng.randrange(10), rng.randrange(10)
    return {"prompt": f"{left}+{right}=", "answer": str(left + right)}


def _add_multi_row(rng: random.Random) -> dict[str, str]:
    left, right = rng.randrange(100), rng.randrange(100)
    return {"prompt": f"{left}+{right}=", "answer": str(left + right)}


TOOL_SHARE = 0.5
"""Of the `multiply` rows' `solved` conversations, the share that use the calculator."""


def _multiply_row(rng: random.Random) -> dict:
    left, right = rng.randrange(10, 100), rng.randrange(10, 100)
    prompt, answer = f"{left}*{right}=", str(left * right)
    call = json.dumps({"name": "calculator", "arguments": {"expression": f"{left}*{right}"}}, separators=(",", ":"))
    transcript = [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "tool", "content": answer},
        {"role": "assistant", "content": answer},
    ]
    solved = transcript if rng.random() < TOOL_SHARE else [transcript[0], transcript[-1]]
    return {"prompt": prompt, "answer": answer, "transcript": transcript, "solved": solved}


COLORS = {"1": (220, 40, 40), "2": (40, 180, 40), "3": (40, 60, 220)}
"""The `color` task's answers and the color each names (red, green, blue)."""
PICTURE_SIZE = 56  # pixels, the tiny vision model's image size (`grpo_dist.models.tiny_vision`)
RADII = range(18, 27)  # the disc's, in pixels: it covers most of the picture, part of every one of its 4 tiles
GREYS = range(90, 201)  # the background's level


def _color_row(rng: random.Random) -> dict:
    answer = rng.choice(sorted(COLORS))
    radius = rng.choice(RADII)
    x, y = (rng.randint(radius, PICTURE_SIZE - radius) for _ in range(2))
    picture = Picture(COLORS[answer], x, y, radius, rng.choice(GREYS))
    return {"prompt": "color:", "answer": answer, "images": [picture]}


@dataclass(frozen=True)
class Picture:
    """A `color` row's picture, drawn when its row is written: a disc of `color` centred at (`x`, `y`) on grey."""

    color: tuple[int, int, int]
    x: int
    y: int
    radius: int
    grey: int

    def draw(self):
        from PIL import Image, ImageDraw

        image = Image.new("RGB", (PICTURE_SIZE, PICTURE_SIZE), (self.grey,) * 3)
        box = (self.x - self.radius, self.y - self.radius, self.x + self.radius, self.y + self.radius)
        ImageDraw.Draw(image).ellipse(box, fill=self.color)
        return image


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task("last_digit", "repeat the last of 2-4 space-separated digits", _last_digit_row, 10**2 + 10**3 + 10**4),
        Task("add", "sum of two single digits", _add_row, 10 * 10),
        Task("add_multi", "sum of two numbers below 100", _add_multi_row, 100 * 100),
        Task("multiply", "product of two 2-digit numbers, with a calculator", _multiply_row, 90 * 90),
        Task(
            "color",
            "the color of a picture's disc, as a digit",
            _color_row,
            len(COLORS) * sum((PICTURE_SIZE + 1 - 2 * radius) ** 2 for radius in RADII) * len(GREYS),
            key=lambda row: repr(row["images"]),
        ),
    )
}


def get_task(name: str) -> Task:
    """The registered task called ``name``; ``ValueError`` listing the valid names otherwise."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}.")
    return TASKS[name]


def make_task_rows(name: str, num_rows: int, seed: int) -> list[dict[str, str]]:
    """``num_rows`` rows of task ``name`` drawn from ``seed`` (prompts may repeat)."""
    task = get_task(name)
    if num_rows < 1:
        raise ValueError(f"make_task_rows: num_rows must be >= 1, got {num_rows}.")
    rng = random.Random(seed)
    return [task.make_row(rng) for _ in range(num_rows)]


def _write_jsonl(rows: list[dict], out_path: str | Path) -> Path:
    """The rows as JSON Lines at `out_path`; a row's pictures (`Picture`) drawn into PNG files in `images/` beside
    it, named by the file and the row, and the row holding their paths relative to it."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for number, row in enumerate(rows):
        if any(isinstance(image, Picture) for image in row.get("images", [])):
            drawn = [_drawn(image, out_path, f"{number}-{at}") for at, image in enumerate(row["images"])]
            row = {**row, "images": drawn}
        lines.append(json.dumps(row) + "\n")
    out_path.write_text("".join(lines), encoding="utf-8")
    return out_path


def _drawn(picture: Picture, beside: Path, name: str) -> str:
    """`picture` drawn into `images/<file>-<name>.png` beside the file `beside`; its path relative to that file's."""
    relative = Path("images") / f"{beside.stem}-{name}.png"
    (beside.parent / relative).parent.mkdir(exist_ok=True)
    picture.draw().save(beside.parent / relative)
    return str(relative)


def write_task(name: str, out_path: str | Path, num_rows: int, seed: int) -> Path:
    """Write ``num_rows`` rows of task ``name`` to the JSON Lines file ``out_path``; return its path."""
    return _write_jsonl(make_task_rows(name, num_rows, seed), out_path)


def _held_out_rows(task: Task, train_prompts: set[str], num_eval: int, seed: int) -> list[dict[str, str]]:
    """Draw eval rows from ``seed``, rejecting train prompts when enough other prompts exist."""
    rng = random.Random(seed)
    if task.num_distinct_prompts - len(train_prompts) < num_eval:
        logger.warning(
            "task %r has only %d distinct prompts; its eval set overlaps the train set",
            task.name,
            task.num_distinct_prompts,
        )
        return [task.make_row(rng) for _ in range(num_eval)]
    rows: list[dict[str, str]] = []
    while len(rows) < num_eval:
        row = task.make_row(rng)
        if task.key(row) not in train_prompts:
            rows.append(row)
    return rows


def split_task(name: str, out_dir: str | Path, num_train: int, num_eval: int, seed: int) -> tuple[Path, Path]:
    """Write ``out_dir/train.jsonl`` and ``out_dir/eval.jsonl`` for task ``name``; return both paths.

    The two sets are drawn from different seeds (``seed`` and ``seed + 1``). When the task has at least
    ``num_eval`` prompts beyond those in the train set, no eval prompt appears in the train set; otherwise
    (``add`` with more than a few train rows) the sets overlap and a warning is logged.
    """
    task = get_task(name)
    if num_eval < 1:
        raise ValueError(f"split_task: num_eval must be >= 1, got {num_eval}.")
    train_rows = make_task_rows(name, num_train, seed)
    eval_rows = _held_out_rows(task, {task.key(row) for row in train_rows}, num_eval, seed + 1)
    out_dir = Path(out_dir)
    return _write_jsonl(train_rows, out_dir / "train.jsonl"), _write_jsonl(eval_rows, out_dir / "eval.jsonl")
