"""Proof that the engines serve what the learner sent.

After every weight sync each engine scores a fixed probe sequence (the first training prompts' tokens, joined, up to
`PROBE_TOKENS`) and the learner scores it too: the mean absolute difference of their per-token log-probabilities is
the engine's gap. An engine that kept its old weights, or dropped an adapter, shows a gap as large as the policy's
change since the weights it held; one that took the sync shows the engines' and the learner's numerical difference
(about 2e-7 in float32 on a CPU; more where either side rounds to bf16). The largest gap is logged as
`sync/probe_gap`.

A gap is a mismatch when it is above `sync.probe_max_gap` and above `MOVED_FRACTION` of how far the learner's own
log-probabilities of the probe moved since the version the engines were last found serving. The second bound tells a
diverging policy from a broken engine: logits grown to thousands leave float32 kernels a gap of about 0.01 per token
(seen at learning rate 50), far over the bound yet a thousandth of the update's own change; an engine that did not
take the update is as far from the learner as the update moved it. The engines are probed once before the first
sync too (`Cluster.check_syncs`), so that the first update's move is measured as well: without it the first sync
had the first bound alone, and a first update that wrecks the policy (learning rate 50: a gap of 0.019 on this
machine's kernels, 0.001 allowed) stopped the run blaming the engine. A mismatch is a fault, handled by the cluster
(every weight sent again, then the run stopped).
"""

from __future__ import annotations

from dataclasses import dataclass

import ray

from grpo_dist.config import Config
from grpo_dist.faults import Bound, RunFailed, gather
from grpo_dist.transports import WeightSyncError

PROBE_TOKENS = 64
MOVED_FRACTION = 0.1
"""A gap is a mismatch only above this fraction of the learner's own move on the probe since the engines' last
checked version (and above the bound): an engine that missed the update is as far as the whole move."""
FLOAT32_GAP = 1e-3
"""The default bound where the learner and the engines both compute in float32."""
HALF_GAP = 0.1
"""The default bound where either computes in bf16 or fp16 (their roundings differ; larger than float32's gap)."""


class ServedWeightsDiffer(RunFailed):
    """An engine's log-probabilities on the probe stayed apart from the learner's after a sync sent again in full."""


def probe_tokens(prompts: list[list[int]], limit: int) -> list[int]:
    """The first prompts' token ids joined, cut at `limit` (at least two: the first token has no log-probability)."""
    tokens = [token for prompt in prompts[:limit] for token in prompt][:limit]
    if len(tokens) < 2:
        raise ValueError("the probe needs at least two tokens: the training prompts have fewer")
    return tokens


def max_gap(cfg: Config) -> float:
    """`sync.probe_max_gap`, or its default for the run's dtypes: float32 only on the CPU (`rollout.dtype` and
    `learner.dtype` auto or float32 without GPUs), else bf16/fp16 on one side at least."""
    if cfg.sync.probe_max_gap is not None:
        return cfg.sync.probe_max_gap
    engines_fp32 = cfg.rollout.dtype == "float32" or (cfg.rollout.dtype == "auto" and cfg.rollout.num_gpus == 0)
    learner_fp32 = cfg.learner.dtype == "float32" or (cfg.learner.dtype == "auto" and cfg.learner.num_gpus == 0)
    return FLOAT32_GAP if engines_fp32 and learner_fp32 else HALF_GAP


@dataclass(frozen=True)
class Probe:
    """One check's findings: each generator's gap, the learner's log-probabilities of the probe and how far they
    moved since the engines' last checked version (None at the first check)."""

    gaps: list[float]
    expected: list[float]
    moved: float | None

    @property
    def worst(self) -> int:
        """The generator with the largest gap."""
        return max(range(len(self.gaps)), key=self.gaps.__getitem__)

    def mismatch(self, max_gap: float) -> bool:
        """Whether the largest gap is over both bounds."""
        gap = self.gaps[self.worst]
        return gap > max_gap and (self.moved is None or gap > MOVED_FRACTION * self.moved)

    def bounds(self, max_gap: float) -> str:
        """The bounds the largest gap was judged against, in words."""
        said = f"sync.probe_max_gap {max_gap:g}"
        if self.moved is None:
            return said
        return f"{said}, and {MOVED_FRACTION:g} of the {self.moved:.3g} per token the learner's own moved since"


@dataclass
class WeightCheck:
    """The probe of one run: its tokens, its bound on the gap and on the calls, and the learner's log-probabilities
    of it at the version the engines were last found serving."""

    tokens: list[int]
    max_gap: float
    bound: Bound  # the sync's: an engine that does not answer the probe in it counts as a failed sync
    served: list[float] | None = None

    @classmethod
    def of(cls, cfg: Config, prompts: list[list[int]]) -> WeightCheck:
        limit = min(PROBE_TOKENS, cfg.rollout.max_model_len - 1)
        return cls(probe_tokens(prompts, limit), max_gap(cfg), Bound(cfg.sync.timeout_s, "sync.timeout_s"))

    def probe(self, learner, generators: list[ray.actor.ActorHandle]) -> Probe:
        """Each generator's mean absolute log-probability gap to the learner on the probe. A generator that fails
        or does not answer within the bound raises `WeightSyncError` (the sync's own handling replaces it)."""
        calls = [generator.sequence_logprobs.remote(self.tokens) for generator in generators]
        expected = learner.sequence_logprobs(self.tokens)
        gaps = []
        for slot, outcome in enumerate(gather(calls, self.bound)):
            if not outcome.ok:
                why = outcome.fault or f"{type(outcome.error).__name__}: {outcome.error}"
                raise WeightSyncError(f"generator {slot} did not answer the probe after a sync: {why}")
            gaps.append(mean_gap(outcome.value, expected))
        moved = None if self.served is None else mean_gap(self.served, expected)
        return Probe(gaps, expected, moved)

    def passed(self, probe: Probe) -> None:
        """The engines serve what `probe` expected: later moves are measured from it."""
        self.served = probe.expected


def mean_gap(got: list[float], want: list[float]) -> float:
    """The mean absolute difference of two sequences' per-token log-probabilities."""
    return sum(abs(a - b) for a, b in zip(got, want, strict=True)) / len(want)
