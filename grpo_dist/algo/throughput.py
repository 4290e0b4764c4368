"""How fast a step went and how much of the hardware it used: tokens per second generated and trained, the
learner's model FLOPs per second and, on a GPU whose peak is known, its model FLOPs utilisation (MFU).

Model FLOPs are counted from the model's shape, not measured: a forward pass over a sequence of L tokens costs
2 N L for the weights (N: the parameters a token's activations meet, the input embedding's lookup excepted) plus
2 layers hidden L^2 for causal attention (the scores and their weighted sum, half of the L x L square each); a
training pass (forward and backward) costs three forward passes (as in the PaLM paper's appendix B). A step counts
each pass it makes: `algorithm.ppo_epochs` training passes, plus one forward each for the reference's and the old
policy's logprobs when it computes them. Activation recomputation (gradient checkpointing) is not counted: MFU is
the useful work done, not the work the hardware did. N counts every parameter: for a mixture of experts, more than
a token meets.

Also the wall time of a step's named phases (`StepTimer`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

PEAK_BF16_FLOPS = (  # dense bf16 tensor-core peak per device, by a pattern of torch.cuda.get_device_name(), in order
    (r"\bH100\b.*\bPCIe\b", 756e12),
    (r"\bH[12]00\b.*\bNVL\b", 835e12),
    (r"\bH100\b|\bH200\b|\bH800\b", 989e12),
    (r"\bA100\b|\bA800\b", 312e12),
    (r"\bL40S\b", 362e12),
    (r"\bL40\b", 181e12),
    (r"\bL4\b", 121e12),
)


def peak_flops(device_name: str | None, bf16: bool) -> float:
    """The device's dense bf16 peak in FLOP/s when it is listed and the learner trains in bf16, else 0 (unknown:
    no MFU is reported, only FLOP/s)."""
    if not device_name or not bf16:
        return 0.0
    return next((flops for pattern, flops in PEAK_BF16_FLOPS if re.search(pattern, device_name)), 0.0)


def flop_params(model) -> int:
    """N: the parameters a token's activations meet, the input embedding's lookup excepted (with tied embeddings
    the matrix is counted once, as the output projection it also is). Under ZeRO-3 each parameter's full size."""
    sizes = {id(p): getattr(p, "ds_numel", p.numel()) for p in model.parameters()}
    embedding = model.get_input_embeddings().weight
    tied = any(p is embedding for p in [getattr(model.get_output_embeddings(), "weight", None)])
    return sum(sizes.values()) - (0 if tied else sizes[id(embedding)])


def forward_flops(lengths: Iterable[int], params: int, layers: int, hidden: int) -> float:
    """Model FLOPs of one forward pass over sequences of these lengths."""
    return float(sum(2 * params * length + 2 * layers * hidden * length * length for length in lengths))


def step_flops(lengths: Iterable[int], params: int, layers: int, hidden: int, passes: int, forwards: int) -> float:
    """Model FLOPs of `passes` training passes and `forwards` forward-only passes over the sequences."""
    return forward_flops(lengths, params, layers, hidden) * (3 * passes + forwards)


def throughput_metrics(metrics: dict[str, float], num_ranks: int) -> dict[str, float]:
    """From a step's metrics: the tokens the generators produced during the step's generation per second of it
    (with `rollout.max_staleness` >= 1 that generation is the next step's batch), trained tokens per second of
    training, the learner's model FLOP/s per rank and, where the device's peak is known, its MFU."""
    found = {}
    if metrics.get("time/generate"):
        generated = metrics.get("generators/tokens", metrics["tokens/generated"])
        found["throughput/generated_tokens_per_s"] = generated / metrics["time/generate"]
    busy = metrics.get("time/learner_busy")
    if busy:
        found["throughput/trained_tokens_per_s"] = metrics["tokens/trained"] / busy
        per_rank = metrics["learner/flops"] / busy / num_ranks
        found["throughput/learner_flops_per_s"] = per_rank
        if metrics.get("learner/peak_flops"):
            found["throughput/mfu"] = per_rank / metrics["learner/peak_flops"]
    return found


class StepTimer:
    """Wall time of named phases of a step: `with timer("generate"): ...` -> {"time/generate": seconds}.
    A phase entered several times (dynamic sampling's rounds) adds up."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            key = f"time/{phase}"
            self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - started
