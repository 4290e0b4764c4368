"""What every weight transport shares: the interface (`WeightTransport`), its error, which transport and wire a
config picks, and the bounded wait on one call per actor."""

from __future__ import annotations

import importlib.util
from typing import Protocol

import ray

from grpo_dist.config import Config
from grpo_dist.faults import Bound, gather


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


class WeightSyncError(RuntimeError):
    """A weight sync failed or did not finish in `sync.timeout_s`; the message names the transport and the actor."""


def transport_name(cfg: Config) -> str:
    """`sync.transport`, with `auto` resolved: broadcast where the installed vLLM has weight transfer."""
    if cfg.sync.transport != "auto":
        return cfg.sync.transport
    return "broadcast" if importlib.util.find_spec("vllm.distributed.weight_transfer") else "object_store"


def wire_backend(cfg: Config) -> str | None:
    """The vLLM weight-transfer backend the generators' engines are built with (None for the object store):
    NCCL when the learner and the engines are both on GPUs and delta sync is off, else gloo."""
    if transport_name(cfg) != "broadcast":
        return None
    on_gpus = cfg.learner.num_gpus > 0 and cfg.rollout.num_gpus > 0
    return "nccl" if on_gpus and not cfg.sync.delta else "gloo"


def wait_all(refs: list[ray.ObjectRef], actors: list[str], call: str, bound: Bound, transport: str) -> list:
    """Results of one call per actor; fails naming the first actor that failed or did not answer within `bound`."""
    outcomes = gather(refs, bound)
    for outcome, actor in zip(outcomes, actors, strict=True):
        if not outcome.ok and not outcome.pending:
            failed = f"{transport} weight sync: {actor}: {call} failed: {outcome.error}"
            raise WeightSyncError(failed) from outcome.error
    hung = [actor for outcome, actor in zip(outcomes, actors, strict=True) if outcome.pending]
    if hung:
        raise WeightSyncError(f"{transport} weight sync: {', '.join(hung)}: {call} did not return within {bound}")
    return [outcome.value for outcome in outcomes]
