"""What every weight transport shares: the interface (`WeightTransport`), its error, which transport and wire a
config picks, and the bounded wait on one call per actor."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import ray

from grpo_dist.config import Config
from grpo_dist.faults import Bound, gather, stacks


class WeightTransport(Protocol):
    name: str

    def connect(self) -> None:
        """Set up whatever the transport needs between the learner ranks and the generators (once)."""

    def sync(self, weight_version: int, full: bool = False):
        """Load the learner's current weights into every generator; their completions then carry the version.
        `full`: send every weight even with delta sync. Returns what the sync sent (a `SyncReport`) where the
        transport reports it, else None."""

    def close(self) -> None:
        """Release the transport's resources (the actors themselves stay up)."""


@dataclass
class SyncReport:
    """What one sync sent (rank 0's; the other ranks only gathered). Defined here, not beside the gloo wire: the
    driver unpickles it, and the wire's module would load vLLM into the driver."""

    mode: str  # "full" or "delta"
    elements: int  # elements of every parameter
    changed: int  # elements sent as changed (every element in a full sync)
    sent_bytes: int
    resync: str | None = None  # why the sync must be done again in full (a worker's copy differed), if it must

    def metrics(self) -> dict[str, float]:
        return {
            "sync/delta": float(self.mode == "delta" and self.resync is None),
            "sync/changed_fraction": self.changed / max(self.elements, 1),
            "sync/sent_mb": self.sent_bytes / 2**20,
        }


class WeightSyncError(RuntimeError):
    """A weight sync failed or did not finish in `sync.timeout_s`; the message names the transport and the actor."""


def transport_name(cfg: Config) -> str:
    """`sync.transport`, with `auto` resolved: broadcast where the installed vLLM has weight transfer."""
    if cfg.sync.transport != "auto":
        return cfg.sync.transport
    return "broadcast" if _has_weight_transfer() else "object_store"


def _has_weight_transfer() -> bool:
    """Whether the installed vLLM has `vllm.distributed.weight_transfer`, found on disk: importing the package to ask
    would load vLLM (seconds) into the driver, which never uses it."""
    spec = importlib.util.find_spec("vllm")  # a top-level package is found without being imported
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    return any((Path(folder) / "distributed" / "weight_transfer").is_dir() for folder in folders)


def serves_adapters(cfg: Config) -> bool:
    """Whether the engines serve the LoRA adapter itself (`learner.lora.serve: adapter`), not merged weights."""
    return cfg.learner.lora is not None and cfg.learner.lora.serve == "adapter"


def adapter_slots(cfg: Config) -> tuple[int, int] | None:
    """(max rank, versions held) for the engines' LoRA slots when they serve adapters, else None: the
    `rollout.max_staleness` + 1 newest versions, and one more while a new one comes in."""
    if not serves_adapters(cfg):
        return None
    return cfg.learner.lora.slot_rank, cfg.rollout.max_staleness + 2


def wire_backend(cfg: Config) -> str | None:
    """The vLLM weight-transfer backend the generators' engines are built with (None for the object store, and for
    adapters): NCCL when the learner and the engines are both on GPUs and delta sync is off, else gloo."""
    if transport_name(cfg) != "broadcast" or serves_adapters(cfg):
        return None
    on_gpus = cfg.learner.num_gpus > 0 and cfg.rollout.num_gpus > 0
    return "nccl" if on_gpus and not cfg.sync.delta else "gloo"


def generator_names(generators: list) -> list[str]:
    """How a transport's errors name the generators it waits on."""
    return [f"generator {index}" for index in range(len(generators))]


def wait_all(
    refs: list[ray.ObjectRef],
    generators: list[ray.actor.ActorHandle],
    call: str,
    bound: Bound,
    transport: str,
    stacks_dir: Path | None = None,
) -> list:
    """Results of one call per generator; fails naming the first that failed or did not answer within `bound` (the
    stacks of those that did not go into `stacks_dir`, named in the error)."""
    actors = generator_names(generators)
    outcomes = gather(refs, bound)
    for outcome, actor in zip(outcomes, actors, strict=True):
        if not outcome.ok and not outcome.pending:
            failed = f"{transport} weight sync: {actor}: {call} failed: {outcome.error}"
            raise WeightSyncError(failed) from outcome.error
    hung = [index for index, outcome in enumerate(outcomes) if outcome.pending]
    if hung:
        names = ", ".join(actors[index] for index in hung)
        where = stacks.dump(
            stacks_dir, f"{transport} weight sync: {call} past {bound}", {actors[i]: generators[i] for i in hung}
        )
        raise WeightSyncError(f"{transport} weight sync: {names}: {call} did not return within {bound}{where}")
    return [outcome.value for outcome in outcomes]
