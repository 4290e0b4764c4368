"""Built-in rewards, lookup by name and dotted path, weighted combination, and fault-tolerant scoring."""

from __future__ import annotations

import concurrent.futures
import math
from pathlib import Path

import pytest

from grpo_dist.config import RESERVED_FIELDS, RewardConfig, RewardFunctionConfig
from grpo_dist.rewards import (
    BUILTIN_REWARDS,
    RewardSpec,
    boxed_format,
    combine,
    exact_answer,
    math_answer,
    number_format,
    resolve_reward,
    score_one,
    weighted_sum,
)
from grpo_dist.rewards.runner import RewardRunner
from grpo_dist.types import Failure, Score, ScoreRequest

FIXTURES = "reward_fixtures"


@pytest.fixture(autouse=True)
def _fixtures_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


@pytest.fixture
def executor():
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        yield pool


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        pytest.param("7", "7", 1.0, id="plain_equal"),
        pytest.param("\\boxed{7}", "7", 1.0, id="boxed_equal"),
        pytest.param("The answer is \\boxed{7}.", 7, 1.0, id="boxed_in_text_int_gold"),
        pytest.param("8", "7", 0.0, id="plain_wrong"),
        pytest.param("\\boxed{8}", "7", 0.0, id="boxed_wrong"),
        pytest.param("$\\frac{1}{2}$", "0.5", 1.0, id="fraction_vs_decimal"),
        pytest.param("no number here", "7", 0.0, id="no_answer"),
        pytest.param("", "7", 0.0, id="empty_completion"),
    ],
)
def test_math_answer(completion: str, answer: str, expected: float) -> None:
    assert math_answer("q", completion, answer=answer) == expected


def test_plain_integers_are_judged_as_math_verify_judges_them() -> None:
    """`math_answer` compares two plain integers without math-verify: the same verdicts as math-verify's, on
    equal and unequal pairs, leading zeros, minus zero, whitespace, and the forms it leaves to math-verify (a plus
    sign, a decimal point, a number past 300 digits)."""
    from math_verify import parse, verify

    from grpo_dist.rewards import builtin

    def math_verify(completion: str, answer: str) -> float:
        gold, predicted = parse(f"${answer.strip()}$", parsing_timeout=None), parse(completion, parsing_timeout=None)
        return 1.0 if gold and predicted and verify(gold, predicted, timeout_seconds=None) else 0.0

    random = __import__("random").Random(0)
    pairs = [("5", "5"), ("05", "5"), ("5", "007"), ("-0", "0"), (" 5\n", "5"), ("12", "1"), ("-3", "3"),
             ("+5", "5"), ("5.0", "5"), ("1" * 301, "1" * 301), ("9" * 40, "9" * 39 + "8")]  # fmt: skip
    pairs += [(str(random.randint(-30, 30)), str(random.randint(-30, 30))) for _ in range(200)]
    verdicts = [
        (math_answer("q", completion, answer=answer), math_verify(completion, answer)) for completion, answer in pairs
    ]
    assert [ours for ours, _ in verdicts] == [theirs for _, theirs in verdicts]
    assert {ours for ours, _ in verdicts} == {0.0, 1.0}
    fast = [pair for pair in pairs if builtin.INTEGER.fullmatch(pair[0])]
    assert len(fast) > 200 and ("+5", "5") not in fast and ("1" * 301, "1" * 301) not in fast


def test_math_answer_runs_off_the_main_thread(executor: concurrent.futures.ThreadPoolExecutor) -> None:
    # math-verify's default signal.alarm timeout raises ValueError outside the main thread.
    assert executor.submit(math_answer, "q", "\\boxed{7}", answer="7").result() == 1.0


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        pytest.param("7", "7", 1.0, id="equal"),
        pytest.param("  7\n", " 7 ", 1.0, id="whitespace_stripped"),
        pytest.param("7", 7, 1.0, id="int_answer"),
        pytest.param("07", "7", 0.0, id="not_numeric_equality"),
        pytest.param("7.", "7", 0.0, id="trailing_dot"),
    ],
)
def test_exact_answer(completion: str, answer: str, expected: float) -> None:
    assert exact_answer("q", completion, answer=answer) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        pytest.param("7", 1.0, id="integer"),
        pytest.param(" -12 \n", 1.0, id="negative_padded"),
        pytest.param("3.25", 1.0, id="decimal"),
        pytest.param(".5", 1.0, id="leading_dot"),
        pytest.param("7 8", 0.0, id="two_numbers"),
        pytest.param("x=7", 0.0, id="text_around"),
        pytest.param("", 0.0, id="empty"),
        pytest.param("1e5", 0.0, id="exponent_not_allowed"),
    ],
)
def test_number_format(completion: str, expected: float) -> None:
    assert number_format("q", completion) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        pytest.param("so \\boxed{42} done", 1.0, id="boxed"),
        pytest.param("\\boxed{\\frac{1}{2}}", 1.0, id="nested_braces"),
        pytest.param("\\boxed{}", 0.0, id="empty_box"),
        pytest.param("boxed{4}", 0.0, id="no_backslash"),
        pytest.param("42", 0.0, id="plain"),
    ],
)
def test_boxed_format(completion: str, expected: float) -> None:
    assert boxed_format("q", completion) == expected


@pytest.mark.parametrize("name", sorted(set(BUILTIN_REWARDS) - {"code_tests"}))  # in the sandbox: test_sandbox.py
def test_builtins_ignore_unknown_fields(name: str) -> None:
    fields = {"answer": "7", "pattern": "[0-9]", "judge_score": 1.0, "reward_model_score": 1.0}  # the pools' scores
    score = resolve_reward(name)("q", "7", **fields, difficulty="easy", source="gsm8k")
    assert score in (0.0, 1.0)


@pytest.mark.parametrize(
    "completion, pattern, expected",
    [
        pytest.param("7", "[0-9]", 1.0, id="one_digit"),
        pytest.param(" 7\n", "[0-9]", 1.0, id="stripped"),
        pytest.param("77", "[0-9]", 0.0, id="two_digits_not_full_match"),
        pytest.param("x7", "[0-9]", 0.0, id="prefix"),
        pytest.param("<answer>3</answer>", r"<answer>\d+</answer>", 1.0, id="tagged"),
    ],
)
def test_regex_format(completion: str, pattern: str, expected: float) -> None:
    assert BUILTIN_REWARDS["regex_format"]("q", completion, pattern=pattern) == expected


def test_resolve_user_reward_by_dotted_path() -> None:
    function = resolve_reward(f"{FIXTURES}.length_reward")
    assert function("q", "abc", scale=2.0) == 6.0


@pytest.mark.parametrize(
    ("name", "message"),
    [
        pytest.param("math_anwser", "Did you mean 'math_answer'", id="typo_suggests_closest"),
        pytest.param("zzzz", "built-in rewards: math_answer", id="unknown_lists_builtins"),
        pytest.param("no_such_pkg.mod.fn", "cannot import module 'no_such_pkg.mod'", id="module_missing"),
        pytest.param(f"{FIXTURES}.nope", "has no attribute 'nope'", id="attribute_missing"),
        pytest.param(f"{FIXTURES}.NOT_CALLABLE", "is a int, not a callable", id="not_callable"),
        pytest.param(".fn", "must look like 'package.module.function'", id="empty_module"),
    ],
)
def test_resolve_reward_errors(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        resolve_reward(name)
    assert repr(name) in str(error.value)


@pytest.mark.parametrize(
    ("scores", "weights", "expected"),
    [
        # 1.0 * 0.5 + 0.0 * 2.0 + 1.0 * -1.0 = -0.5
        pytest.param([1.0, 0.0, 1.0], [0.5, 2.0, -1.0], -0.5, id="weighted_sum"),
        pytest.param([], [], 0.0, id="no_functions"),
        pytest.param([1.0, math.nan], [1.0, 0.0], math.nan, id="nan_even_with_zero_weight"),
    ],
)
def test_combine(scores: list[float], weights: list[float], expected: float) -> None:
    result = combine(scores, weights)
    assert math.isnan(result) if math.isnan(expected) else result == pytest.approx(expected)


def test_combine_length_mismatch() -> None:
    with pytest.raises(ValueError, match="2 scores but 1 weights"):
        combine([1.0, 1.0], [1.0])


@pytest.mark.parametrize(
    ("scores", "weights", "expected", "why"),
    [
        # 1e308 + 1e308 = 2e308 > float64's largest (1.8e308): fsum raises OverflowError, caught.
        pytest.param([1e308, 1e308], [1.0, 1.0], math.nan, "the weighted sum of the rewards overflows", id="1e308x2"),
        # 1e300 * 1e300 = inf for one term alone.
        pytest.param([1e300], [1e300], math.nan, "the weighted sum of the rewards overflows", id="term_overflows"),
        # 1e200 * 1e200 = inf and 1e200 * -1e200 = -inf: fsum raises ValueError for inf - inf, caught.
        pytest.param([1e200, 1e200], [1e200, -1e200], math.nan, "the weighted sum of the rewards overflows",
                     id="inf_minus_inf"),
        # 3.5e38 is beyond float32's largest 3.4e38 (it would be inf in a float32 tensor), and beyond 1e30.
        pytest.param([3.5e38], [1.0], math.nan, "the weighted sum of the rewards, 3.5e+38, is beyond +-1e+30",
                     id="3.5e38"),
        # 1e31 - 1e31 = 0, but each weighted score is beyond 1e30.
        pytest.param([1e31, 1e31], [1.0, -1.0], math.nan, "a reward or weighted reward, 1e+31, is beyond +-1e+30",
                     id="cancelling_terms_beyond_the_limit"),
        pytest.param([math.inf, 1.0], [1.0, 1.0], math.nan, "a reward is inf, not a finite number", id="inf"),
        pytest.param([1.0, -math.inf], [1.0, 1.0], math.nan, "a reward is -inf, not a finite number", id="-inf"),
        pytest.param([math.nan, 1.0], [1.0, 1.0], math.nan, "a reward function failed", id="nan"),
        # 1e30 * 1 + 0 * 5 = 1e30: at the limit, scored.
        pytest.param([1e30, 0.0], [1.0, 5.0], 1e30, None, id="at_the_limit"),
        # 0.1 + 0.2 summed exactly (fsum): 0.30000000000000004 as float64 rounds the exact 0.3000...0166.
        pytest.param([0.1, 0.2], [1.0, 1.0], 0.1 + 0.2, None, id="small"),
    ],
)  # fmt: skip
def test_weighted_sum_is_float64_and_unscored_out_of_range(
    scores: list[float], weights: list[float], expected: float, why: str | None
) -> None:
    total, reason = weighted_sum(scores, weights)
    assert math.isnan(total) if math.isnan(expected) else total == expected
    assert reason is None if why is None else reason.startswith(why), reason
    combined = combine(scores, weights)  # combine never raises either
    assert math.isnan(combined) if math.isnan(total) else combined == total


def test_a_sum_out_of_range_is_the_completions_failure_counted_in_reward_failures(capsys) -> None:
    """Both functions score 1e308: each is a number, their sum is not. The worker names why, the pool counts it in
    `reward_failures/weighted_sum` (no call failed: `why/*` stay 0), and advantages leave the completion out."""
    from grpo_dist.cluster.actors.reward_worker import RewardWorker
    from grpo_dist.cluster.reward_pool import RewardFailures
    from grpo_dist.config import RewardConfig, RewardFunctionConfig

    functions = [RewardFunctionConfig(name=f"{FIXTURES}.length_reward", kwargs={"scale": 1e308})] * 2
    worker = RewardWorker(RewardConfig(functions=functions, sandbox=False), judges=[])
    try:
        # "a" scores 1e308 * 1 twice: unscored; "" scores 0 twice: 0.
        (overflowing, empty), _, _ = worker.score([ScoreRequest("q", "a", {}), ScoreRequest("q", "", {})])
    finally:
        worker.runner.close()
    assert math.isnan(overflowing.total) and overflowing.per_function == [1e308, 1e308]
    assert overflowing.failures == {
        "weighted_sum": Failure("weighted_sum", "the weighted sum of the rewards overflows")
    }
    assert (empty.total, empty.failures) == (0.0, {})
    failures = RewardFailures([f"{FIXTURES}.length_reward"] * 2, max_fraction=0.9, max_steps=3)
    failures.observe([overflowing, empty])
    metrics = failures.end_step()
    assert metrics["reward_failures/weighted_sum"] == 1.0 and metrics["reward_failures/why/raised"] == 0.0
    assert (
        "reward weighted_sum failed (weighted_sum): the weighted sum of the rewards overflows"
        in capsys.readouterr().out
    )


def test_reward_spec_rejects_nan_weight() -> None:
    with pytest.raises(ValueError, match="'exact_answer': weight must be a finite number"):
        RewardSpec("exact_answer", weight=math.nan)


def test_score_one_all_succeed(executor: concurrent.futures.ThreadPoolExecutor) -> None:
    fns = [exact_answer, resolve_reward(f"{FIXTURES}.length_reward")]
    # exact: "7" == "7" -> 1.0; length: 0.5 * len("7") = 0.5; combined 1.0 * 2.0 + 0.5 * 1.0 = 2.5
    combined, scores, errors = score_one(
        fns, [2.0, 1.0], [{}, {"scale": 0.5}], "q", "7", {"answer": "7"}, timeout_s=5.0, executor=executor
    )
    assert (combined, scores, errors) == (2.5, [1.0, 0.5], [None, None])


def test_spec_kwargs_override_row_fields(executor: concurrent.futures.ThreadPoolExecutor) -> None:
    _, scores, errors = score_one(
        [exact_answer], [1.0], [{"answer": "8"}], "q", "8", {"answer": "7"}, timeout_s=5.0, executor=executor
    )
    assert (scores, errors) == ([1.0], [None])


ROW_WITH_SETTINGS = {"answer": "7", "isolation": "best_effort", "memory_mb": 1 << 20, "budget_s": 1e9,
                     "timeout_per_test_s": 1e9, "strict": False}  # fmt: skip
"""A row that would lift the jail's memory cap, drop `require`, stretch its time and let its tests be judged in the
code's process, were its fields passed on."""


def test_a_rows_fields_never_set_the_jail_of_code_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """The jail's settings come from the `reward` section, its per-test time from the config's kwargs (or its own
    default), never from the row: the call `code_tests` gets is recorded, no jail started."""
    calls = []
    monkeypatch.setitem(BUILTIN_REWARDS, "code_tests", lambda prompt, completion, **kwargs: calls.append(kwargs) or 1.0)
    functions = [RewardFunctionConfig(name="code_tests")]
    reward = RewardConfig(functions=functions, sandbox=False, isolation="require", sandbox_memory_mb=512, timeout_s=3)
    runner = RewardRunner(["code_tests"], reward)
    fields = {"tests": ["assert add(1, 2) == 3"], **ROW_WITH_SETTINGS}
    try:
        runner.score([0], [1.0], [{"timeout_per_test_s": 2.0}], "q", "c", fields)
        runner.score([0], [1.0], [{}], "q", "c", fields)
    finally:
        runner.close()
    settings = {"isolation": "require", "memory_mb": 512, "budget_s": 3.0}
    assert set(settings) | {"timeout_per_test_s", "strict"} == set(RESERVED_FIELDS)
    row = {"tests": ["assert add(1, 2) == 3"], "answer": "7"}
    assert calls == [{**row, "timeout_per_test_s": 2.0, **settings}, {**row, **settings}]


@pytest.mark.parametrize("sandbox", [True, False], ids=["sandbox", "threads"])
def test_a_rows_field_named_as_a_setting_never_reaches_a_reward(sandbox: bool) -> None:
    name = f"{FIXTURES}.fields_seen_reward"
    reward = RewardConfig(functions=[RewardFunctionConfig(name=name)], sandbox=sandbox, timeout_s=30)
    runner = RewardRunner([name], reward)
    try:
        total, _, errors = runner.score([0], [1.0], [{}], "q", "7", ROW_WITH_SETTINGS)
    finally:
        runner.close()
    assert (total, errors) == (100.0, [None])  # 100: the row's answer reached it; + 0: none of the five settings


@pytest.mark.parametrize(
    ("name", "kwargs", "kind", "message"),
    [
        pytest.param("raising_reward", {}, "raised", "RuntimeError: reward server unreachable", id="raises"),
        pytest.param("slow_reward", {"delay_s": 1.0}, "timeout", "timed out after 0.2s", id="times_out"),
        pytest.param(
            "nan_reward", {}, "raised", "ValueError: returned nan, expected a finite number", id="returns_nan"
        ),
        pytest.param(
            "inf_reward", {}, "raised", "ValueError: returned inf, expected a finite number", id="returns_inf"
        ),
        pytest.param("exiting_reward", {}, "raised", "SystemExit: 3", id="calls_sys_exit"),
        pytest.param(
            "string_reward", {}, "raised", "TypeError: returned str '1.0', expected a float", id="returns_string"
        ),
        pytest.param("out_of_memory_reward", {}, "memory", "MemoryError", id="memory"),
        pytest.param("unscorable_reward", {}, "unscorable", "Unscorable: the row has no `answer`", id="unscorable"),
    ],
)
def test_score_one_failure_gives_nan_and_error(
    executor: concurrent.futures.ThreadPoolExecutor, name: str, kwargs: dict, kind: str, message: str
) -> None:
    fns = [exact_answer, resolve_reward(f"{FIXTURES}.{name}")]
    combined, scores, errors = score_one(
        fns, [1.0, 1.0], [{}, kwargs], "q", "7", {"answer": "7"}, timeout_s=0.2, executor=executor
    )
    assert math.isnan(combined)
    assert scores[0] == 1.0 and math.isnan(scores[1])
    assert errors == [None, Failure(kind, message)]


def test_a_worker_without_a_sandbox_with_half_its_threads_stuck_asks_to_be_replaced() -> None:
    from grpo_dist.cluster.actors.reward_worker import RewardWorker
    from grpo_dist.config import RewardConfig, RewardFunctionConfig

    # One function and the judge -> 8 threads; each request leaves one call sleeping past the 0.1 s limit.
    slow = RewardFunctionConfig(name=f"{FIXTURES}.slow_reward", kwargs={"delay_s": 3.0})
    worker = RewardWorker(RewardConfig(functions=[slow], timeout_s=0.1, sandbox=False), judges=["math_answer"])
    request = ScoreRequest("q", "7", {})
    scores, exhausted, _ = worker.score([request] * 3)
    assert not exhausted and scores[0].failures == {
        f"{FIXTURES}.slow_reward": Failure("timeout", "timed out after 0.1s")
    }
    _, exhausted, _ = worker.score([request])
    assert exhausted  # 4 of 8 threads stuck


def test_a_run_scoring_nothing_stops_naming_each_functions_first_error(capsys) -> None:
    from grpo_dist.cluster.reward_pool import RewardFailures
    from grpo_dist.faults import RunFailed

    failures = RewardFailures(["a", "b"], max_fraction=0.5, max_steps=2)
    bad, good = Score(math.nan, [math.nan, 1.0], {"a": Failure("sandbox_died", "x")}), Score(1.0, [1.0, 1.0])
    failures.observe([bad, bad, good])  # 2 of 3 unscored: over 0.5
    counts = failures.end_step()
    assert counts["reward_failures/a"] == 2.0 and counts["reward_failures/b"] == 0.0
    assert counts["reward_failures/why/sandbox_died"] == 2.0 and counts["reward_failures/why/timeout"] == 0.0
    assert capsys.readouterr().out.count("reward a failed (sandbox_died): x") == 1  # the first of its kind only
    failures.observe([good, good])
    failures.end_step()  # a good step ends the streak
    failures.observe([bad])
    failures.end_step()
    failures.observe([bad, good, bad])
    with pytest.raises(RunFailed, match=r"for 2 steps in a row.*a: x"):
        failures.end_step()


@pytest.mark.parametrize("on_failure", ["floor", "unscored"])
@pytest.mark.parametrize(
    ("name", "kwargs", "kind"),
    [
        pytest.param("raising_reward", {}, "raised", id="raises"),
        pytest.param("slow_reward", {"delay_s": 1.0}, "timeout", id="times_out"),
        pytest.param("out_of_memory_reward", {}, "memory", id="memory"),
    ],
)
def test_a_call_the_completion_made_fail_scores_the_floor_unless_told_to_leave_it_unscored(
    on_failure: str, name: str, kwargs: dict, kind: str
) -> None:
    """`reward.on_failure: floor` (the default): the failing function scores its floor, which enters the weighted
    sum like a score; `unscored`: the completion is unscored, as a failure of the machine leaves it."""
    from grpo_dist.cluster.actors.reward_worker import RewardWorker

    failing = RewardFunctionConfig(name=f"{FIXTURES}.{name}", kwargs=kwargs, weight=2.0, floor=-1.0)
    functions = [failing, RewardFunctionConfig(name="exact_answer")]
    reward = RewardConfig(functions=functions, sandbox=False, timeout_s=0.2, on_failure=on_failure)
    worker = RewardWorker(reward, judges=[])
    try:
        [score], _, _ = worker.score([ScoreRequest("q", "7", {"answer": "7"})])
    finally:
        worker.runner.close()
    assert score.failures[f"{FIXTURES}.{name}"].kind == kind
    if on_failure == "floor":  # 2 x -1 (its floor) + 1 x 1 (exact_answer) = -1
        assert (score.total, score.per_function) == (-1.0, [-1.0, 1.0])
    else:
        assert math.isnan(score.total) and math.isnan(score.per_function[0]) and score.per_function[1] == 1.0


def test_the_floor_is_the_default_and_zero_for_every_function() -> None:
    reward = RewardConfig(functions=[RewardFunctionConfig(name="math_answer")])
    assert (reward.on_failure, reward.functions[0].floor) == ("floor", 0.0)


@pytest.mark.parametrize(
    ("kind", "floored"),
    [("timeout", True), ("raised", True), ("memory", True), ("crashed", True), ("sandbox_died", False),
     ("worker_lost", False), ("processes", False), ("network", False), ("unscorable", False)],
)  # fmt: skip
def test_only_a_failure_of_the_completions_making_takes_the_floor(kind: str, floored: bool) -> None:
    from grpo_dist.rewards.registry import with_floors

    [score] = with_floors([math.nan], [Failure(kind, "why")], [0.5])
    assert score == 0.5 if floored else math.isnan(score)
    assert with_floors([0.25], [None], [0.5]) == [0.25]  # a call that scored keeps its score


def test_floored_completions_are_counted_by_kind_never_stop_a_run_and_are_said_once(capsys) -> None:
    """Four completions of four, each with a failed call scored 0 (the floor): counted in `reward_failures/floored`
    and by kind, `unscored` stays 0, so no stop however long it lasts; the first error of each kind is printed, and
    the function failing on more than `max_fraction` of a step's completions is said once per run."""
    from grpo_dist.cluster.reward_pool import RewardFailures
    from grpo_dist.faults import RunFailed

    failures = RewardFailures(["a", "b"], max_fraction=0.5, max_steps=2)
    timed_out = Score(1.0, [0.0, 1.0], {"a": Failure("timeout", "timed out after 10s")})
    raised_ = Score(1.0, [0.0, 1.0], {"a": Failure("raised", "RecursionError: maximum recursion depth exceeded")})
    for _ in range(3):
        failures.observe([timed_out, timed_out, raised_, raised_])
        metrics = failures.end_step()  # never raises: nothing is unscored
    assert metrics["reward_failures/floored"] == 4.0 and metrics["reward_failures/a"] == 4.0
    assert (metrics["reward_failures/why/timeout"], metrics["reward_failures/why/raised"]) == (2.0, 2.0)
    out = capsys.readouterr().out
    assert out.count("reward a failed (timeout): timed out after 10s (it scored the function's floor") == 1
    assert out.count("reward a failed (raised): RecursionError") == 1
    assert out.count("warning: reward a failed on 4 of 4 completions this step, each scored its floor") == 1
    unscored = RewardFailures(["a", "b"], max_fraction=0.5, max_steps=1, floor=False)  # reward.on_failure: unscored
    unscored.observe([Score(math.nan, [math.nan, 1.0], {"a": Failure("timeout", "timed out after 10s")})])
    with pytest.raises(RunFailed, match="unscored for 1 steps in a row"):
        unscored.end_step()


HOSTILE_ANSWERS = [
    pytest.param("9^9^9^9", "a tower of powers", id="tower"),
    pytest.param("\\boxed{9^{9^{9^{9}}}}", "a tower of powers", id="braced_tower"),
    pytest.param("\\boxed{9**9**9**9}", "a tower of powers", id="python_tower"),
    pytest.param("\\boxed{10^{10}!}", "a tower of powers", id="factorial_exponent"),
    pytest.param("\\boxed{9^{999999}}", "a power of more than 100000 digits", id="huge_power"),
    pytest.param("\\boxed{(10^{10})!}", "the factorial of '(10^{10})'", id="factorial_of_a_power"),
    pytest.param("\\boxed{100000000!}", "the factorial of '100000000'", id="huge_factorial"),
    pytest.param("(" * 3000 + "1" + ")" * 3000, "brackets nested 3000 deep", id="3000_parentheses"),
    pytest.param("\\boxed{" + "{" * 20 + "7" + "}" * 20 + "}", "brackets nested 21 deep", id="nested_braces"),
    pytest.param("\\boxed{" + "1+" * 5000 + "1}", "a \\boxed{} of more than 1000 characters", id="long_boxed"),
    pytest.param("7 " * 100_001, "longer than 200000 characters", id="long"),
]


@pytest.mark.parametrize(("completion", "why"), HOSTILE_ANSWERS)
def test_math_answer_refuses_what_would_cost_its_parser_seconds_as_wrong(completion: str, why: str) -> None:
    """Each of these runs math-verify past a 10 s `reward.timeout_s` (or sympy out of memory); the bounds refuse it
    before any parsing, so it scores 0, a wrong answer, not a failure. The alarm only keeps a regression from
    hanging the suite: the assertion is on the refusal and the score, never on a time."""
    import signal

    from grpo_dist.rewards.bounds import refusal

    def overran(*_: object) -> None:
        raise AssertionError("math_answer was not refused before parsing")

    previous = signal.signal(signal.SIGALRM, overran)
    signal.alarm(5)
    try:
        assert why in (refusal(completion) or "")
        assert math_answer("q", completion, answer="7") == 0.0
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        pytest.param("The answer is **7**.", "7", id="markdown_bold"),
        pytest.param("**Answer:** $2^{10}$", "1024", id="power"),
        pytest.param("So 5! = 120, and \\boxed{120}", "120", id="small_factorial"),
        pytest.param("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", id="nested_latex"),
        pytest.param("Wow\\! \\boxed{e^{-x^2}}", "e^{-x^2}", id="symbolic_tower"),
        pytest.param(
            "\\boxed{\\left(\\frac{1}{2}, \\frac{\\sqrt{3}}{2}\\right)}",
            "(\\frac{1}{2}, \\frac{\\sqrt{3}}{2})",
            id="pair",
        ),
    ],
)
def test_the_bounds_let_every_natural_answer_through(completion: str, answer: str) -> None:
    from grpo_dist.rewards.bounds import refusal

    assert refusal(completion) is None
    assert math_answer("q", completion, answer=answer) == 1.0
