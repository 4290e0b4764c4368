"""The typed messages that cross actor boundaries: one dataclass per boundary, plain Python fields only."""

from __future__ import annotations

from dataclasses import dataclass, field

REWARD_LIMIT = 1e30
"""The largest magnitude a score, a weighted score or a completion's weighted sum may have; beyond it the completion
is unscored. Rewards reach the advantages as float32 tensors (largest 3.4e38): within this limit every sum, group
difference and leave-one-out scaling the estimators make (at most 4 x F x the limit, for F reward functions) stays
finite, with room for F up to about 1e7."""

FLOORED_KINDS = ("timeout", "raised", "memory", "crashed")
"""Reward calls the completion made fail: it ran past `reward.timeout_s` (wall clock, or the sandbox's CPU time), the
function raised (or returned no finite number), ran out of the sandbox's memory, or ended its sandbox process (a
crash, an exit). Under `reward.on_failure: floor` (the default) such a call scores its function's floor."""
UNSCORED_KINDS = ("sandbox_died", "worker_lost", "processes", "network", "unscorable")
"""Reward calls that failed for the machine or the setup, never the completion: the sandbox killed from outside
(SIGKILL, SIGTERM), failing to start or answering out of protocol; the reward worker lost; a process, thread or the
network refused by the sandbox's settings; the reward raising `Unscorable`. Such a call leaves its completion
unscored."""
FAILURE_KINDS = FLOORED_KINDS + UNSCORED_KINDS
"""Why a reward call has no score of its own, as counted in `reward_failures/why/<kind>`."""

RESERVED_FIELDS = {
    "isolation": "reward.isolation",
    "memory_mb": "reward.sandbox_memory_mb",
    "budget_s": "reward.timeout_s",
    "timeout_per_test_s": "reward.functions[].kwargs of code_tests",
    "strict": "reward.functions[].kwargs of code_tests",
}
"""The names no field of a dataset row may have, each with the config key that sets it: the settings of the jail
`code_tests` runs the model's code in, which it takes as keyword arguments. A row's fields are passed to the reward
functions as keyword arguments, and a row must not set how its completions are judged (lift the memory cap, drop
`require`, stretch the time), so `grpo_dist.run.inputs` refuses a row that carries one before a run starts, and a reward
call never passes one on (`grpo_dist.rewards.registry.call_kwargs`)."""


class Unscorable(Exception):
    """Raised by a reward function that cannot judge a completion for a reason that is not the completion's (a row
    without the field it reads, a judge without a verdict, an outside service down): the completion is unscored,
    never given the floor a completion that breaks its grader gets."""


@dataclass(frozen=True)
class Failure:
    """Why one reward call has no score of its own."""

    kind: str
    """One of `FAILURE_KINDS`, set where the failure was seen (never read from its message, which the completion
    may shape); `weighted_sum` for a completion whose scores are all there but sum out of range."""
    reason: str
    """What happened, as printed: the exception and its message, the time limit, how the sandbox ended."""

    @property
    def floored(self) -> bool:
        """Whether the completion caused it (`FLOORED_KINDS`), so that it may score its function's floor."""
        return self.kind in FLOORED_KINDS

    def __str__(self) -> str:
        return self.reason


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
    """`stop` (EOS or stop string) or `length` (hit max_new_tokens); of a trajectory also `failed` (user code
    raised: `episode.failure`; it holds no tokens and is unscored)."""
    weight_version: int
    """Version of the policy weights that produced it (0 = the initial model); the oldest, when its tokens were
    sampled by more than one (a weight update came while it was generated)."""
    newest_weight_version: int | None = None
    """The newest version that sampled any of its tokens, when that is not `weight_version`; else None."""
    generator: int | None = None
    """The slot of the generator that sampled it (set by the generator pool)."""
    mask: list[int] | None = None
    """[T] with an environment: 1 on the tokens the model sampled (trained), 0 on the observation tokens between its
    turns (whose `logprobs` are 0); None: every token was sampled."""
    episode: Episode | None = None
    """With an environment: how the multi-turn trajectory went; `text` is then the model's last turn."""
    teacher_logprobs: list[float] | None = None
    """[T] with `algorithm.distill`: the teacher's log-probability of each of `token_ids` after the same prefix
    (set by the teacher pool); None when no teacher scored it; NaN for a token past the teacher's positions."""

    @property
    def sampled_tokens(self) -> int:
        """How many of `token_ids` the model sampled."""
        return len(self.token_ids) if self.mask is None else sum(self.mask)


@dataclass
class Episode:
    """How one multi-turn trajectory went (generator -> driver): for rewards, metrics and the completion table."""

    messages: list[dict] = field(default_factory=list)
    """The whole conversation: the first messages, then each model turn and observation."""
    turns: int = 0
    """Model turns."""
    tool_calls: int = 0
    """Tool calls read from its turns, malformed ones included."""
    tool_errors: int = 0
    """Calls answered with an error: malformed, no such tool, wrong arguments, raised, timed out."""
    tool_seconds: float = 0.0
    """Wall time its tool calls took, together."""
    truncated: bool = False
    """Cut (a turn's token limit, `environment.max_total_tokens` or `max_turns`) before the environment said done."""
    rewards: dict[str, float] = field(default_factory=dict)
    """The environment's reward parts, summed per name over its turns (of an agent: what it returned)."""
    diverged: bool = False
    """An agent sent a conversation that did not extend the previous call's: its later calls are not trained."""
    failure: str | None = None
    """Why the trajectory failed, when the user's code raised: `<where> raised <type>: <first line>` (its
    environment's constructor, `reset` or `step`, the tool parser, or the agent). It then holds no tokens and is
    unscored; `messages` are those up to the failure."""


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
    failure: str | None = None
    """Why it cannot be scored (its trajectory failed: `Episode.failure`): no function is called, it is unscored."""
    turns: list[dict] | None = None
    """The prompt's chat turns before any chat template (None: the row's prompt had none), what a reward model reads
    through its own template (`reward.model`); not passed to the reward functions."""


@dataclass
class Score:
    """The reward of one completion: reward worker -> driver."""

    total: float
    """Weighted sum of the functions' values (float64); NaN (the completion is unscored) when a function failed
    for the machine (`UNSCORED_KINDS`, or any failure under `reward.on_failure: unscored`), the sum overflows or a
    value is beyond `grpo_dist.rewards.REWARD_LIMIT`, or its trajectory failed."""
    per_function: list[float]
    """Value of each configured reward function, in config order: its floor where the completion made its call fail
    (`FLOORED_KINDS`, under `reward.on_failure: floor`), NaN where it failed otherwise."""
    failures: dict[str, Failure] = field(default_factory=dict)
    """Each failing function's configured name -> why its call failed (floored or not, as `per_function` says), or
    `weighted_sum` -> why the sum of scores that are all there is out of range. Empty when every call scored, and
    for a failed trajectory (`Episode.failure` says why)."""
