"""A vLLM general plugin (entry point `vllm.general_plugins`), which vLLM loads in every process it starts: in the
engine processes a generator starts, it has them die with the generator. A killed generator would otherwise leave its
engine core running, holding its memory, long after the run."""

from __future__ import annotations

import os

from grpo_dist.actors import die_with_parent


def die_with_generator() -> None:
    """In a process of a generator's engine (marked by its environment, `ENGINE_MARK`): die with its parent."""
    from grpo_dist.actors.generator import ENGINE_MARK

    if os.environ.get(ENGINE_MARK) == "1":
        die_with_parent()
