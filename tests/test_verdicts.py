"""`code_tests` judges outside the model's process: the attacks that passed tests from inside it (a patched `exec`,
a wrapped `json.loads`, a stand-in for `sys.stdin`, values equal to everything, forged replies) each score what the
code solves, with the jail (bubblewrap) as a reward worker runs it; the split itself, the strict reading of the
jail's replies and the verdicts reached here are checked without one."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from grpo_dist.config import RewardConfig, RewardFunctionConfig
from grpo_dist.rewards import counters
from grpo_dist.rewards.code import IN_PROCESS, code_tests, same_output
from grpo_dist.rewards.verdicts import ENCODING, NotPlain, Split, decode, judge, split_test

TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]
SOLVED = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return 0\n"  # passes neither test
CHECK = """
METADATA = {'author': 'jt'}


def check(candidate):
    assert candidate(3.5) == 0.5
    assert abs(candidate(1.33) - 0.33) < 1e-6
    assert True, "a message"
"""
"""HumanEval's test of `truncate_number` (HumanEval/2), as its rows hold it."""
LOOP = "for a in range(3):\n    assert add(a, 1) == a + 1"  # a loop: not split, runs in the code's process


def score(completion: str, tests: list = TESTS, **kwargs) -> float:
    return code_tests("", completion, tests, timeout_per_test_s=5.0, isolation="require", **kwargs)


# The attacks that scored 1.0 when the verdict was reached in the code's own process.
ATTACKS = {
    "exec-patched": WRONG + "import builtins\nbuiltins.exec = lambda *args, **kwargs: None\n",
    "eval-patched": WRONG + "import builtins\nbuiltins.eval = lambda *args, **kwargs: True\n",
    "json-loads-wrapped": WRONG + "import json\nreal = json.loads\n"
    "def loads(text, *args, **kwargs):\n    request = real(text, *args, **kwargs)\n"
    "    if 'test' in request:\n        request['test'] = 'pass'\n"
    "    if 'holes' in request:\n        request['holes'] = ['True' for _ in request['holes']]\n    return request\n"
    "json.loads = loads\n",
    "stdin-stand-in": WRONG + "import json, sys\nreal = sys.stdin.buffer\n"
    "class Buffer:\n    def readline(self):\n        request = json.loads(real.readline())\n"
    "        request.update(test='pass', setup='', holes=['None'] * len(request.get('holes', [])))\n"
    "        return json.dumps(request).encode() + b'\\n'\n"
    "class Stand:\n    buffer = Buffer()\nsys.stdin = Stand()\n",
    "always-equal": "class Equal:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
    "def add(a, b):\n    return Equal()\n",
    "int-subclass": "class Int(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
    "def add(a, b):\n    return Int(0)\n",
    "str-subclass-in-a-list": "class Str(str):\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = str.__hash__\ndef add(a, b):\n    return [Str('x')]\n",
    "type-patched": "import builtins\nclass Equal(int):\n    def __eq__(self, other):\n        return True\n"
    "builtins.type = lambda value: int\ndef add(a, b):\n    return Equal(0)\n",
}


@pytest.mark.parametrize("completion", ATTACKS.values(), ids=ATTACKS.keys())
def test_an_attack_from_inside_the_process_scores_what_the_code_solves(completion):
    """Wrong code with each attack scores 0, as wrong code does: the verdict is reached here."""
    assert score(completion) == 0.0


def test_a_correct_solution_scores_1_whatever_standard_type_it_returns():
    """A generator is converted in the jail (`set(...)` is part of the hole); a `Counter` or a named tuple is read
    as the dict or tuple it compares equal to, by dict's and tuple's own methods."""
    assert score(SOLVED) == 1.0
    sets = ["assert set(common((3, 4, 5), (5, 4, 9))) == set((4, 5))", "assert sorted(common([1], [1])) == [1]"]
    assert score("def common(a, b):\n    return (x for x in a if x in b)\n", sets) == 1.0
    counted = "from collections import Counter, namedtuple\nPair = namedtuple('Pair', 'x y')\n"
    counted += "def count(text):\n    return Counter(text)\ndef pair():\n    return Pair(1, 2)\n"
    assert score(counted, ["assert count('aab') == {'a': 2, 'b': 1}", "assert pair() == (1, 2)"]) == 1.0


def test_a_forged_reply_is_worth_the_value_it_claims_and_no_more():
    """The code hooks the request, writes `3` for every hole on the status pipe itself and exits: the parent judges
    3 against each expected value it never sent, so the forgery scores what `return 3` scores (one test of two)."""
    forger = (
        "import json, os, sys\nstatus = int(sys.argv[1])\nreal = json.loads\n"
        "def loads(text, *args, **kwargs):\n    request = real(text, *args, **kwargs)\n"
        "    for _ in request.get('holes', []):\n        os.write(status, b'[\"int\", \"3\"]\\n')\n"
        "    if 'holes' in request:\n        os._exit(0)\n    return request\njson.loads = loads\n"
    )
    assert score(WRONG + forger) == score("def add(a, b):\n    return 3\n") == 0.5


def test_a_humaneval_check_splits_and_is_judged_here():
    split = split_test(CHECK, "truncate_number")
    assert isinstance(split, Split) and split.holes == ("candidate(3.5)", "candidate(1.33)")
    assert "candidate = truncate_number" in split.setup and "0.33" not in split.setup + "".join(split.holes)
    assert score("def truncate_number(x):\n    return x % 1.0\n", [CHECK], entry_point="truncate_number") == 1.0
    assert score("def truncate_number(x):\n    return 0.5\n", [CHECK], entry_point="truncate_number") == 0.0


@pytest.mark.parametrize(
    ("program", "passed"),
    [
        pytest.param("a, b = map(int, input().split())\nprint(a + b)\n", 1.0, id="input"),
        pytest.param("import sys\nprint(sum(map(int, open(0).read().split())), '  ')\nsys.exit(0)\n", 1.0, id="fd0"),
        pytest.param("print(3)\n", 0.5, id="wrong"),  # right for `1 2` only
        pytest.param("print(3)\nraise SystemExit(1)\n", 0.0, id="exits-1"),
        pytest.param("print('x' * (4 << 20))\n", 0.0, id="floods"),
    ],
)
def test_a_stdin_stdout_case_is_compared_here(program, passed):
    cases = [{"input": "1 2\n", "output": "3\n"}, {"input": "20 22", "output": "42"}]
    assert score(program, cases) == passed


def test_output_is_compared_line_by_line_blanks_normalized():
    assert same_output(b"1  2 \n3\n\n\n", "1 2\n3")
    assert not same_output(b"1\n2\n", "1 2\n") and not same_output(b"12\n", "1 2\n")


def test_an_unsplit_test_runs_in_the_process_counted_and_strict_refuses_it():
    counters.take()
    assert score(SOLVED, [LOOP, *TESTS]) == 1.0 and score(WRONG, [LOOP]) == 0.0
    assert counters.take() == {IN_PROCESS: 2.0}
    with pytest.raises(ValueError, match=r"code_tests \(strict\): test 0 cannot be judged outside .* \(`For`\)"):
        score(SOLVED, [LOOP, *TESTS], strict=True)
    assert score(SOLVED, strict=True) == 1.0 and counters.take() == {}


def test_the_in_process_protocol_still_holds_its_own_forgeries():
    """A test that is not split is judged by the nonce: exiting 0 early or writing `ran` everywhere passes none."""
    early_exit = WRONG + "import os\nos._exit(0)\n"
    assert score(early_exit, [LOOP]) == 0.0 and score(SOLVED, [LOOP]) == 1.0


def test_the_reward_worker_hands_back_its_counts_with_the_scores():
    from grpo_dist.cluster.actors.reward_worker import RewardWorker
    from grpo_dist.types import ScoreRequest

    reward = RewardConfig(functions=[RewardFunctionConfig(name="code_tests")], sandbox=False, timeout_s=30)
    worker = RewardWorker(reward, judges=[])
    counters.take()  # what earlier tests here counted
    try:
        scores, _, counts = worker.score([ScoreRequest("add", SOLVED, {"tests": [LOOP, *TESTS]})] * 2)
    finally:
        worker.runner.close()
    assert [each.total for each in scores] == [1.0, 1.0] and counts == {IN_PROCESS: 2.0}


def test_the_pool_logs_the_count_every_step_and_says_it_once(capsys):
    from grpo_dist.cluster.reward_pool import RewardFailures, RewardPool

    pool = RewardPool.__new__(RewardPool)  # its metrics alone
    pool.failures, pool.isolation, pool.judge, pool.model = RewardFailures(["code_tests"], 0.9, 3), {}, None, None
    pool.counts, pool.counted, pool.said = Counter(), {IN_PROCESS}, set()
    assert pool.step_metrics()[IN_PROCESS] == 0.0
    for _ in range(2):
        pool.counts.update({IN_PROCESS: 3.0})
        assert pool.step_metrics()[IN_PROCESS] == 3.0
    assert capsys.readouterr().out.count("code_tests/in_process: 3 this step, tests code_tests could not split") == 1


SPLITS = {
    "plain": ("assert f(3) == 7", None, ("f(3)",)),
    "expected-first": ("assert 7 == f(3)", None, ("f(3)",)),
    "truth": ("assert not is_odd(4)", None, ("is_odd(4)",)),
    "is-none": ("assert f([]) is None", None, ("f([])",)),
    "isclose": ("import math\nassert math.isclose(area(2), 12.56, rel_tol=0.01)", None, ("area(2)",)),
    "method": ("assert Solution().solve([1]) == [1]", None, ("Solution().solve([1])",)),
    "wrapped": ("assert round(mean([1, 2]), 2) == 1.5", None, ("round(mean([1, 2]), 2)",)),
    "two-sides": ("assert f(1) == f(2)", None, ("f(1)", "f(2)")),
    "setup-data": ("data = [3, 1]\nassert f(data) == [1, 3]", None, ("f(data)",)),
    "entry-named-as-builtin": ("assert sum(10, 15) == 6", "sum", ("sum(10, 15)",)),
}


@pytest.mark.parametrize(("test", "entry_point", "holes"), SPLITS.values(), ids=SPLITS.keys())
def test_a_test_splits_into_holes_without_its_expected_value(test, entry_point, holes):
    split = split_test(test, entry_point)
    assert isinstance(split, Split) and split.holes == holes


UNSPLIT = {
    "loop": (LOOP, None),
    "expected-from-setup": ("expected = [1]\nassert f(2) == expected", None),
    "helper": ("def ok(g):\n    return g(2) == 4\nassert ok(f)", None),
    "unknown-call-around": ("import sys\nassert f(1) == sys.getsizeof(1)", None),
    "print": ("print(f(1))\nassert f(1) == 2", None),
    "setup-asserts": ("def h():\n    assert f(1) == 2\nassert f(2) == 3", None),
    "check-without-entry-point": (CHECK, None),
    "shadowed-builtin": ("assert sum(10, 15) == 6", None),
    "lambda-around": ("assert (lambda v: v == 3)(f(1))", None),
    "is-a-number": ("assert f(1) is 5", None),
    "syntax-error": ("assert f(1) ==", None),
    "star-import": ("from math import *\nassert isclose(f(1), 1.5)", None),  # else `isclose(...)` were the code's
}


@pytest.mark.parametrize(("test", "entry_point"), UNSPLIT.values(), ids=UNSPLIT.keys())
def test_a_test_that_cannot_be_split_says_why(test, entry_point):
    assert isinstance(split_test(test, entry_point), str)


def test_abs_of_a_difference_sends_the_call_alone():
    """`abs(f(x) - 0.33) < 1e-6`: were the whole left side sent, the code would learn 0.33 and answer 0."""
    split = split_test("assert abs(f(1.33) - 0.33) < 1e-6")
    assert split.holes == ("f(1.33)",)
    assert judge(split.conditions[0], [1.33 - 1]) and not judge(split.conditions[0], [0.0])


def plain(value):
    namespace = {}
    exec(ENCODING, namespace)
    return namespace["plain"](value)


@pytest.mark.parametrize(
    "value",
    [None, True, 3, -(10**40), 0.5, math.inf, "é\ud800", b"\x00\xff", [1, (2, {3})], {"a": [None]}, set(), ()],
    ids=repr,
)
def test_plain_data_round_trips_through_the_encoding(value):
    import json

    assert decode(json.dumps(plain(value)).encode()) == value


class Int(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


@pytest.mark.parametrize(
    "value",
    [Int(1), [Int(1)], {1: Int(1)}, object(), 1j, frozenset(), iter([])],
    ids=["int_subclass", "in_a_list", "in_a_dict", "object", "complex", "frozenset", "iterator"],
)
def test_the_encoding_refuses_what_is_not_exactly_plain(value):
    with pytest.raises(TypeError):
        plain(value)


@pytest.mark.parametrize(
    "line",
    [
        b"7",  # untagged
        b'["int", 7]',  # an int must be its digits as a string
        b'["int", "7.5"]',
        b'["int", "' + b"9" * 5000 + b'"]',
        b'["bool", 1]',
        b'["set", [["list", []]]]',  # a set of a list
        b'["dict", [[["list", []], ["none"]]]]',
        b'["none", 1]',
        b'["frozen", []]',
        b"[" * 100 + b"]" * 100,
        b'["list", ' + b'["list", ' * 40 + b"[]" + b"]" * 81,
        b"not json",
    ],
)
def test_a_reply_that_is_not_plain_data_is_refused(line):
    with pytest.raises(NotPlain):
        decode(line)


@pytest.mark.parametrize(
    ("condition", "values", "holds"),
    [
        ("f() == [1, 2]", [[1, 2]], True),
        ("f() == (1, 2)", [[1, 2]], False),  # a list is not a tuple
        ("f() is True", [1], False),
        ("f() * 2 == 6", [3], True),
        ("f() * 2 == 'aa'", ["a"], False),  # arithmetic on numbers only: no value builds a huge object here
        ("min(f(), 5) == 3", [3], True),
        ("f() < 3", ["a"], False),  # raising is failing
        ("f()[0] == 1 and not f()[1:]", [1, []], True),
    ],
)
def test_a_verdict_is_reached_here_on_plain_values(condition, values, holds):
    split = split_test(f"assert {condition}")
    assert isinstance(split, Split) and len(split.holes) == len(values)
    assert judge(split.conditions[0], values) is holds
