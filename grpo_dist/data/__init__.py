"""Prompt datasets (JSON Lines / Parquet) and the bundled synthetic tasks.

May import: `models`, `sandbox`, `storage` and below."""

from grpo_dist.data.dataset import DatasetError, PromptRecord, PromptSampler, encode_prompts, load_rows
from grpo_dist.data.tasks import TASKS, Task, get_task, make_task_rows, split_task, write_task

__all__ = [
    "TASKS",
    "DatasetError",
    "PromptRecord",
    "PromptSampler",
    "Task",
    "encode_prompts",
    "get_task",
    "load_rows",
    "make_task_rows",
    "split_task",
    "write_task",
]
