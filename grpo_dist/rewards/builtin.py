"""Built-in reward functions: plain callables ``(prompt, completion, **fields) -> float``.

``fields`` are the dataset row's other fields (``answer=...``); each function takes the ones it needs and ignores
the rest (``**_``), so any reward can be used with any dataset that has those fields.

``math_answer`` runs math-verify with its signal-based timeouts switched off (``parsing_timeout=None``,
``timeout_seconds=None``): ``signal.alarm`` works only on the main thread and rewards run in worker threads.
The time limit is enforced by the caller instead (:func:`grpo_dist.rewards.registry.score_one`), and before any
of that a completion whose answer would cost the parser seconds (a tower of powers, a huge factorial, deep nesting:
:mod:`grpo_dist.rewards.bounds`) is refused as wrong, in microseconds.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from grpo_dist.rewards.bounds import refusal
from grpo_dist.types import Unscorable

# math-verify warns on every call that its own timeout is off; the caller enforces one (see above).
logging.getLogger("math_verify").setLevel(logging.ERROR)

NUMBER_PATTERN = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
BOXED_PATTERN = re.compile(r"\\boxed\{.+?\}", re.DOTALL)
INTEGER = re.compile(r"\s*-?[0-9]{1,300}\s*")
"""A plain integer of up to 300 digits, nothing else but whitespace around it: `math_answer` compares two such
exactly, as math-verify judges them (a leading zero or a minus zero changes nothing), without parsing them with sympy
(half a millisecond a call, the quick start's whole scoring)."""


def math_answer(prompt: str, completion: str, answer: Any, **_: Any) -> float:
    """1.0 if math-verify judges the completion's final answer equal to ``answer``, else 0.0.

    The gold ``answer`` may be plain (``"7"``, ``"1/2"``) or LaTeX (``"\\frac{1}{2}"``); the completion may be
    plain text or contain ``\\boxed{...}``. A completion `bounds.refusal` refuses scores 0 unparsed.
    """
    if refusal(completion) is not None:
        return 0.0
    gold_text = str(answer)
    if INTEGER.fullmatch(completion) and INTEGER.fullmatch(gold_text):  # math-verify's verdict, without sympy
        return 1.0 if int(completion) == int(gold_text) else 0.0
    from math_verify import parse, verify  # imported here: sympy makes it slow to import

    gold = parse(_as_math(gold_text), parsing_timeout=None)
    predicted = parse(completion, parsing_timeout=None)
    if not gold or not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0


def _warm_math_answer() -> None:
    """One call on a fixed answer that needs math-verify (a plain integer would not): what math-verify and sympy
    import and build on their first call."""
    math_answer("", "1/2", answer="\\frac{1}{2}")


math_answer.sandbox_warmup = _warm_math_answer  # run once by a sandbox's server, so that no call's process does it


def _as_math(text: str) -> str:
    """Wrap a bare gold answer in ``$...$`` so math-verify parses it as LaTeX (``"7"`` -> ``"$7$"``)."""
    text = text.strip()
    return text if "$" in text or "\\boxed" in text else f"${text}$"


def exact_answer(prompt: str, completion: str, answer: Any, **_: Any) -> float:
    """1.0 if the completion, stripped of surrounding whitespace, equals ``str(answer)`` stripped, else 0.0."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


def environment(prompt: str, completion: str, environment_reward: float = 0.0, **_: Any) -> float:
    """The reward parts an environment gave the trajectory, summed (`grpo_dist.agents.Observation.reward`)."""
    return float(environment_reward)


def judge(
    prompt: str, completion: str, judge_score: float | None = None, judge_failure: str | None = None, **_: Any
) -> float:
    """The verdict of the LLM judge (`reward.judge`), asked by the judge pool before the reward functions run."""
    if judge_score is None:  # the judge's failure, not the completion's: unscored
        raise Unscorable(judge_failure or "no verdict: reward.judge is not set")
    return float(judge_score)


def reward_model(
    prompt: str,
    completion: str,
    reward_model_score: float | None = None,
    reward_model_failure: str | None = None,
    **_: Any,
) -> float:
    """The score of the reward model (`reward.model`), asked by its pool before the reward functions run."""
    if reward_model_score is None:  # the reward model's failure, not the completion's: unscored
        raise Unscorable(reward_model_failure or "no score: reward.model is not set")
    return float(reward_model_score)


def tool_use(prompt: str, completion: str, messages: list | None = None, **_: Any) -> float:
    """1.0 when a trajectory called tools and every call was answered without an error (`error: ...`), else 0.0."""
    answers = [m.get("content", "") for m in messages or [] if m.get("role") == "tool"]
    return 1.0 if answers and not any(str(a).startswith("error:") for a in answers) else 0.0


def number_format(prompt: str, completion: str, **_: Any) -> float:
    """1.0 if the stripped completion is one integer or decimal number (``"7"``, ``"-3.5"``), else 0.0."""
    return 1.0 if NUMBER_PATTERN.fullmatch(completion.strip()) else 0.0


def boxed_format(prompt: str, completion: str, **_: Any) -> float:
    """1.0 if the completion contains a non-empty ``\\boxed{...}``, else 0.0."""
    return 1.0 if BOXED_PATTERN.search(completion) else 0.0


def regex_format(prompt: str, completion: str, pattern: str, **_: Any) -> float:
    """1.0 if the stripped completion matches ``pattern`` (a Python regex) in full, else 0.0.

    ``pattern`` comes from the reward's ``kwargs`` in the config, e.g. ``{pattern: "[0-9]"}`` for one digit.
    """
    return 1.0 if re.fullmatch(pattern, completion.strip()) else 0.0
