"""The typed messages that cross actor boundaries: one dataclass per boundary, plain Python fields only."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Completion:
    """One sampled completion: generator -> driver."""

    prompt_index: int
    """Position of its prompt in the rollout batch; the group key."""
    prompt_token_ids: list[int]
    """The prompt as the engine saw it, [P]."""
    token_ids: list[int]
    """Sampled completion tokens, [T] (EOS included when the model stopped)."""
    text: str
    """Decoded completion, special tokens skipped."""
    logprobs: list[float]
    """Log-probability of each sampled token under the sampling distribution, [T]."""
    finish_reason: str
    """`stop` (EOS or stop string) or `length` (hit max_new_tokens)."""
    weight_version: int
    """Version of the policy weights that produced it (0 = the initial model); the oldest, when its tokens were
    sampled by more than one (a weight update came while it was generated)."""
    newest_weight_version: int | None = None
    """The newest version that sampled any of its tokens, when that is not `weight_version`; else None."""
    generator: int | None = None
    """The slot of the generator that sampled it (set by the generator pool)."""


@dataclass
class Sampling:
    """How an evaluation samples (driver -> generator); training samples as `rollout` says."""

    temperature: float
    """0: greedy."""
    top_p: float
    max_tokens: int


@dataclass
class ScoreRequest:
    """A completion to score: driver -> reward worker."""

    prompt: str
    """The prompt text as the model saw it."""
    completion: str
    """The completion text."""
    fields: dict = field(default_factory=dict)
    """The dataset row's other fields (e.g. `answer`), passed to the reward functions as keyword arguments."""


@dataclass
class Score:
    """The reward of one completion: reward worker -> driver."""

    total: float
    """Weighted sum of the functions' values; NaN when any function failed (the completion is unscored)."""
    per_function: list[float]
    """Value of each configured reward function, in config order; NaN where it failed."""
    failures: dict[str, str] = field(default_factory=dict)
    """Why the completion is unscored: each failing function's configured name -> its exception, time-out or the
    worker's loss. Empty when every function returned a finite number."""
