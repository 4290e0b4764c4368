"""Find reward functions by name and score one completion with several of them, never raising for user code.

A reward is named either as a built-in (``"math_answer"``, see :data:`BUILTIN_REWARDS`) or as the dotted path
of a user function (``"my_pkg.rewards.length_penalty"``). A completion's reward is the weighted sum of its
functions' scores. A call that fails scores NaN with a `Failure` saying why and of what kind; the reward worker then
gives a call the completion made fail (it timed out, raised, ran out of memory: `types.FLOORED_KINDS`) its
function's floor (`with_floors`), so that breaking the grader never pays better than a wrong answer, and leaves any
other NaN, which makes the weighted sum NaN: the completion is unscored rather than silently scored 0. So does a
weighted sum that overflows or any value beyond ``REWARD_LIMIT`` (what the float32 advantages hold safely): no value
a reward returns can stop the run.
"""

from __future__ import annotations

import concurrent.futures
import difflib
import importlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpo_dist.rewards.builtin import (
    boxed_format,
    environment,
    exact_answer,
    judge,
    math_answer,
    number_format,
    regex_format,
    reward_model,
    tool_use,
)
from grpo_dist.rewards.code import code_tests
from grpo_dist.types import RESERVED_FIELDS, REWARD_LIMIT, Failure, Unscorable

RewardFn = Callable[..., float]
"""``(prompt: str, completion: str, **fields) -> float``."""

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math_answer": math_answer,
    "exact_answer": exact_answer,
    "number_format": number_format,
    "boxed_format": boxed_format,
    "regex_format": regex_format,
    "code_tests": code_tests,
    "environment": environment,
    "tool_use": tool_use,
    "judge": judge,
    "reward_model": reward_model,
}


@dataclass(frozen=True)
class RewardSpec:
    """One reward term as configured: which function, its weight, and extra keyword arguments for it."""

    name: str  # a key of BUILTIN_REWARDS or a dotted path "package.module.function"
    weight: float = 1.0  # multiplies this function's score in the weighted sum
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to every call; they override same-named row fields

    def __post_init__(self) -> None:
        if not math.isfinite(self.weight):
            raise ValueError(f"RewardSpec {self.name!r}: weight must be a finite number, got {self.weight}.")


def call_kwargs(
    fields: dict[str, Any], kwargs: dict[str, Any], settings: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The keyword arguments of one reward call: the row's `fields`, the config's `kwargs` over them, and the jail's
    `settings` (`code_tests`: its isolation, memory and time budget) over both. A field named as a setting
    (`types.RESERVED_FIELDS`) never reaches the call: the input checks refuse such a row before a run starts, and
    this keeps it from a call all the same."""
    kept = {name: value for name, value in fields.items() if name not in RESERVED_FIELDS}
    return {**kept, **kwargs, **(settings or {})}


def _unknown_builtin(name: str) -> ValueError:
    close = difflib.get_close_matches(name, list(BUILTIN_REWARDS), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(
        f"unknown reward {name!r}; built-in rewards: {', '.join(BUILTIN_REWARDS)}.{hint} "
        f"For your own function give its dotted path, e.g. 'my_pkg.rewards.my_reward'."
    )


def _import_user_reward(path: str) -> RewardFn:
    module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(f"reward {path!r}: a dotted path must look like 'package.module.function'.")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or whatever the module raised while being imported
        raise ValueError(
            f"reward {path!r}: cannot import module {module_name!r} ({type(error).__name__}: {error}); "
            f"check the spelling and that it is on PYTHONPATH on every node."
        ) from error
    if not hasattr(module, attribute):
        raise ValueError(f"reward {path!r}: module {module_name!r} has no attribute {attribute!r}.")
    function = getattr(module, attribute)
    if not callable(function):
        raise ValueError(f"reward {path!r}: {attribute!r} is a {type(function).__name__}, not a callable.")
    return function


def resolve_reward(name: str) -> RewardFn:
    """The built-in reward called ``name``, or the user function at dotted path ``name``; ``ValueError`` if none."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if "." not in name:
        raise _unknown_builtin(name)
    return _import_user_reward(name)


WEIGHTED_SUM = "weighted_sum"
"""The key of `Score.failures` (and `reward_failures/weighted_sum`) naming why a completion whose functions all
scored is unscored all the same: the weighted sum of their scores overflows or is beyond `REWARD_LIMIT`."""


def weighted_sum(scores: list[float], weights: list[float]) -> tuple[float, str | None]:
    """``(sum(w * s), None)``, summed exactly in float64; or ``(NaN, why)``: a score is NaN (its function failed)
    or infinite, the sum overflows, or a score, a weighted score or the sum is beyond ``REWARD_LIMIT``."""
    if len(scores) != len(weights):
        raise ValueError(f"combine: {len(scores)} scores but {len(weights)} weights; pass one weight per score.")
    if any(math.isnan(score) for score in scores):
        return math.nan, "a reward function failed"
    if not all(math.isfinite(score) for score in scores):
        return math.nan, f"a reward is {next(s for s in scores if not math.isfinite(s))}, not a finite number"
    terms = [score * weight for score, weight in zip(scores, weights, strict=True)]
    try:
        total = math.fsum(terms)
    except (OverflowError, ValueError):  # an intermediate sum beyond float64, or inf - inf of two weighted scores
        return math.nan, "the weighted sum of the rewards overflows"
    if math.isinf(total):  # a finite score times a large weight: that term alone is beyond float64
        return math.nan, "the weighted sum of the rewards overflows"
    if not abs(total) <= REWARD_LIMIT:
        return math.nan, f"the weighted sum of the rewards, {total:g}, is beyond +-{REWARD_LIMIT:g} (REWARD_LIMIT)"
    beyond = next((value for value in [*scores, *terms] if not abs(value) <= REWARD_LIMIT), None)
    if beyond is not None:
        return math.nan, f"a reward or weighted reward, {beyond:g}, is beyond +-{REWARD_LIMIT:g} (REWARD_LIMIT)"
    return total, None


def combine(scores: list[float], weights: list[float]) -> float:
    """Weighted sum ``sum(w * s)`` in float64; NaN (the completion is unscored) where ``weighted_sum`` gives a
    reason: a NaN score, an overflow, or a value beyond ``REWARD_LIMIT``. Never raises for the values."""
    return weighted_sum(scores, weights)[0]


def to_score(value: Any) -> float:
    """``float(value)``, rejecting values that are not numbers (a str "1" is a bug in the reward, not a score)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"returned {type(value).__name__} {value!r}, expected a float")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"returned {score}, expected a finite number")
    return score


def with_floors(scores: list[float], failures: list[Failure | None], floors: list[float]) -> list[float]:
    """Each score, with its function's floor in place of the NaN of a call the completion made fail
    (`Failure.floored`: it timed out, raised, ran out of memory or ended its sandbox); other NaNs are kept."""
    return [
        floor if failure is not None and failure.floored else score
        for score, failure, floor in zip(scores, failures, floors, strict=True)
    ]


def raised(error: BaseException) -> Failure:
    """The failure of a call that raised `error`: `unscorable` when the reward said so (`Unscorable`), `memory` for a
    `MemoryError`, else `raised`."""
    kind = "unscorable" if isinstance(error, Unscorable) else "memory" if isinstance(error, MemoryError) else "raised"
    return Failure(kind, f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)


def _wait_for_score(
    future: concurrent.futures.Future, deadline: float, timeout_s: float
) -> tuple[float, Failure | None]:
    """The score of one submitted call, or NaN and why it has none."""
    try:
        return to_score(future.result(timeout=max(0.0, deadline - time.monotonic()))), None
    except concurrent.futures.TimeoutError:
        future.cancel()  # frees the slot if it never started; a running call cannot be stopped
        return math.nan, Failure("timeout", f"timed out after {timeout_s:g}s")
    except BaseException as error:  # user code, even sys.exit(): any failure is a NaN score, reported to the caller
        return math.nan, raised(error)


def score_one(
    fns: list[RewardFn],
    weights: list[float],
    kwargs_list: list[dict[str, Any]],
    prompt: str,
    completion: str,
    fields: dict[str, Any],
    timeout_s: float,
    executor: concurrent.futures.ThreadPoolExecutor,
) -> tuple[float, list[float], list[Failure | None]]:
    """Score one completion with every function in ``executor``; return ``(combined, scores, errors)``.

    Function ``i`` is called as ``fns[i](prompt, completion, **call_kwargs(fields, kwargs_list[i]))`` (its kwargs
    win over same-named row fields; a field named as a setting is dropped). All calls are submitted at once and
    each gets ``timeout_s`` seconds from submission, queueing included, so give the executor at least as many
    threads as calls in flight. A call that raises, times out, exits or returns a non-number or a non-finite one
    scores NaN, and ``errors[i]`` says why and of what kind (``None`` where function ``i`` succeeded).
    A timed-out call keeps its thread until it returns: Python cannot kill a thread.
    """
    if not len(fns) == len(weights) == len(kwargs_list):
        raise ValueError(
            f"score_one: got {len(fns)} functions, {len(weights)} weights and {len(kwargs_list)} kwargs; "
            f"pass one of each per reward function."
        )
    deadline = time.monotonic() + timeout_s
    futures = [
        executor.submit(function, prompt, completion, **call_kwargs(fields, kwargs))
        for function, kwargs in zip(fns, kwargs_list, strict=True)
    ]
    scores, errors = [], []
    for future in futures:
        score, error = _wait_for_score(future, deadline, timeout_s)
        scores.append(score)
        errors.append(error)
    return combine(scores, weights), scores, errors
