"""A vLLM general plugin (entry point `vllm.general_plugins`), which vLLM loads in every process it starts. In the
engine processes a generator starts, it has them die with the generator: a killed generator would otherwise leave its
engine core running, holding its memory, long after the run. In every vLLM process it asks Linux for the AMX tile
state, which vLLM's bfloat16 CPU attention uses without asking: on a CPU with AMX, a bfloat16 engine otherwise dies of
an illegal instruction on its first request."""

from __future__ import annotations

import os

from grpo_dist.sandbox.privileges import die_with_parent


def prepare_engine_process() -> None:
    """Enable AMX where the CPU has it; in a process of a generator's engine (marked by its environment,
    `ENGINE_MARK`): die with its parent."""
    import torch

    from grpo_dist.cluster.actors.engine import ENGINE_MARK

    torch.cpu._init_amx()  # False, and nothing done, where the CPU or the kernel has no AMX
    if os.environ.get(ENGINE_MARK) == "1":
        die_with_parent()
