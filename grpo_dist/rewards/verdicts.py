"""The trusted half of `code_tests`: a test split, with Python's `ast`, into what the model's code must compute (run
in its jail) and the verdict on it (reached here), and the strict reading of the plain data the jail sends back.

Why a split: once the completion's code has run, it owns its interpreter. It can patch `exec`, `json.loads` or
`sys.stdin`, return an object equal to everything, or print anything to the status pipe; a verdict reached in that
process is its word. So the process only computes. A test `assert f(3) == 7` becomes the hole `f(3)`, sent to the
jail after the code ran, whose value comes back as plain data (None, bool, int, float, str, bytes and lists,
tuples, dicts and sets of them, tagged with their exact types); the expected side `7` and the comparison never
enter that process, and are evaluated here, on what `decode` made of the reply.

Why a forged reply gains nothing: the code learns the hole (`f(3)`) and may answer with any plain value. Any value
it can write is one a function `f` could have returned for that call (a function may inspect its caller too), so a
test it passes by forging is a test some `f` passes: it has found the value the test wants for that input, which is
what the reward pays for. What it cannot learn is the expected value: that stays here. Hence the rules of the
split, each keeping the expected side out of the hole:
  - a hole is a call of the code's own names (`f(...)`, `candidate(...)`, `Solution().solve(...)`, a bare name the
    code defines), with any arguments (they are the task's inputs), wrapped at most by conversions that add no
    value to compare with (`list`, `sorted`, `set`, `len`, `round(., n)`, `str`, indexing by a constant, ...), so
    that code returning a generator or a map still passes;
  - everything around the holes (`==`, `<`, `in`, `is None`, `and`, `not`, arithmetic, `abs`, `math.isclose`, ...)
    and the expected side are judged here, by `judge`, an evaluator of that small grammar over plain values that
    calls nothing else: `abs(candidate(1.33) - 0.33) < 1e-6` sends `candidate(1.33)` alone, never `0.33`.
The expected side is a literal, or a call of those pure functions on literals (`set((4, 5))`), evaluated here. A
test whose expected side needs more (a name its setup binds, a helper, a loop, randomness) or which is not made of
asserts is not split (`split_test` says why): `code_tests` runs it in the completion's process, as before, and
counts it. Not running such expected sides at all keeps every value of the verdict here, from the test's text.

What the split leaves: the test's setup (imports, data, `candidate = <entry point>`) and the holes are sent to the
code's process, so it may read them: they are the task's inputs. Where the prompt itself shows the tests (MBPP's
do), the code can still answer them by lookup, as in any grader; held-out tests are the remedy there.
"""

from __future__ import annotations

import ast
import builtins
import functools
import json
import math
import re
import sys
from dataclasses import dataclass
from typing import Any

ENCODING = r'''
import collections
DICTS = (dict, collections.Counter, collections.OrderedDict, collections.defaultdict)
def plain(value, depth=0):
    """`value` as tagged JSON-ready data, types checked exactly (a subclass, with its own `__eq__`, is not plain).
    The standard library's dicts (a `Counter`, ...) and named tuples are read as a dict and a tuple, by dict's and
    tuple's own methods, as they compare with them (`Counter(a=1) == {"a": 1}`)."""
    kind = type(value)
    if depth > 32:
        raise ValueError("nested too deep")
    if kind.__bases__ == (tuple,) and hasattr(kind, "_fields"):
        return ["tuple", [plain(item, depth + 1) for item in tuple.__iter__(value)]]
    if value is None:
        return ["none"]
    if kind is bool or kind is str:
        return [kind.__name__, value]
    if kind is int:
        return ["int", int.__repr__(value)]
    if kind is float:
        return ["float", float.__repr__(value)]
    if kind is bytes:
        return ["bytes", bytes.hex(value)]
    if kind is list or kind is tuple or kind is set:
        return [kind.__name__, [plain(item, depth + 1) for item in value]]
    if any(kind is each for each in DICTS):
        return ["dict", [[plain(key, depth + 1), plain(item, depth + 1)] for key, item in dict.items(value)]]
    raise TypeError(f"{kind.__name__} is not plain data")
'''
"""The jail's encoder (part of its runner): the honest path. A process whose code replaced it can send anything,
which is why `decode` trusts nothing it reads."""

MAX_DEPTH = 32  # nesting of a value read back
MAX_NODES = 100_000  # values in one reply
MAX_TEXT = 4300  # characters of an int (Python's own limit on int("...")) or a float
INTEGER = re.compile(r"-?[0-9]+")
SCALARS = {"bool": bool, "str": str}
CONTAINERS = {"list": list, "tuple": tuple, "set": set}


class NotPlain(ValueError):
    """A reply that is not the plain data `ENCODING` writes."""


def decode(line: bytes) -> Any:
    """The value a jail reported, read strictly: JSON of `ENCODING`'s tags and nothing else, at most `MAX_DEPTH`
    deep and `MAX_NODES` values. `NotPlain` for anything else (malformed, a set of lists, an int of 5000 digits)."""
    try:
        tree = json.loads(line)
        return _value(tree, 0, [MAX_NODES])
    except NotPlain:
        raise
    except (ValueError, TypeError, RecursionError, UnicodeDecodeError) as error:
        raise NotPlain(f"not plain data: {type(error).__name__}") from None


def _value(tree: Any, depth: int, budget: list[int]) -> Any:
    budget[0] -= 1
    if type(tree) is not list or not tree or type(tree[0]) is not str or depth > MAX_DEPTH or budget[0] < 0:
        raise NotPlain("not a tagged value, or too deep or too large")
    tag, rest = tree[0], tree[1:]
    if tag == "none" and not rest:
        return None
    if len(rest) != 1:
        raise NotPlain(f"tag {tag[:20]!r} with {len(rest)} fields")
    item = rest[0]
    if tag in SCALARS and type(item) is SCALARS[tag]:
        return item
    if tag == "int" and type(item) is str and len(item) <= MAX_TEXT and INTEGER.fullmatch(item):
        return int(item)
    if tag == "float" and type(item) is str and len(item) <= MAX_TEXT:
        return float(item)
    if tag == "bytes" and type(item) is str:
        return bytes.fromhex(item)
    if tag in CONTAINERS and type(item) is list:
        return CONTAINERS[tag](_value(each, depth + 1, budget) for each in item)
    if tag == "dict" and type(item) is list and all(type(pair) is list and len(pair) == 2 for pair in item):
        return {_value(key, depth + 1, budget): _value(value, depth + 1, budget) for key, value in item}
    raise NotPlain(f"tag {tag[:20]!r} with a {type(item).__name__}")


@dataclass(frozen=True)
class Slot:
    """Where a hole's value goes in a condition judged here."""

    index: int


@dataclass(frozen=True)
class Split:
    """A test judged here: the jail runs `setup` after the code, then evaluates each of `holes` in turn and sends
    back its value; each of `conditions` (the test's asserts, their holes replaced by `Slot`s) must then hold."""

    setup: str  # the test's imports and data, and `candidate = <entry point>` for a `check(candidate)`
    holes: tuple[str, ...]  # Python expressions, in the order the asserts reach them
    conditions: tuple[ast.expr, ...]


PARENT_CALLS: dict[str, Any] = {
    **{name: getattr(builtins, name) for name in ("abs", "all", "any", "chr", "max", "min", "ord", "sum")},
    **{name: getattr(builtins, name) for name in ("bool", "dict", "float", "frozenset", "int", "len", "list")},
    **{name: getattr(builtins, name) for name in ("round", "set", "sorted", "str", "tuple")},
    **{f"math.{name}": getattr(math, name) for name in ("isclose", "fabs", "floor", "ceil", "sqrt")},
}
"""The functions `judge` calls, all pure on plain data and none building more than it is given (no `range`)."""
WRAPPERS = {"abs", "bool", "dict", "float", "frozenset", "int", "len", "list", "round", "set", "sorted", "str", "tuple"}
"""Of those, the ones a hole may be wrapped in (its first argument; any other a literal: `round(f(x), 2)`): they
add no value to compare with, and turn a generator or a map the code returns into plain data. So do `REDUCTIONS`
with a single argument."""
REDUCTIONS = {"all", "any", "max", "min", "sum"}
OPERATORS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod)  # on numbers only
NUMBERS = (int, float, bool)
SINGLETONS = (None, True, False)  # what `is` compares with
SETUP = (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign, ast.FunctionDef, ast.ClassDef, ast.Pass)

CONST, INPUT, CODE, MIXED = "const", "input", "code", "mixed"
"""What an expression of a test is: a literal (or pure calls on literals), the test's own data (names its setup
binds), the code's work (a hole, whole), or a verdict around holes (judged here)."""


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


def _root(node: ast.expr) -> str | None:
    """The name an expression like `a.b(c)[0].d` starts from."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _singleton(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and any(node.value is value for value in SINGLETONS)


class _Splitter(ast.NodeTransformer):
    """Tells what each expression of a test is (`CONST` ... `MIXED`) and cuts the holes out of its conditions."""

    def __init__(self, bound: set[str], code_names: set[str]) -> None:
        self.bound, self.code_names = bound, code_names  # the setup's names; the code's (`candidate`, entry point)
        self.holes: list[str] = []
        self.kinds: dict[int, str | None] = {}

    def condition(self, node: ast.expr) -> ast.expr | None:
        """`node` with its holes cut out (`Slot`s), or None where it cannot be judged here."""
        return self.visit(node) if self.kind(node) in (CODE, CONST, MIXED) else None

    def visit(self, node: ast.AST) -> Any:
        """The cut: a `CODE` part becomes a hole; a literal stays; a verdict is cut inside (in place: the tree is
        the one `split_test` parsed)."""
        kind = self.kind(node) if isinstance(node, ast.expr) else MIXED
        if kind == CODE:
            self.holes.append(ast.unparse(node))
            return ast.copy_location(ast.Constant(Slot(len(self.holes) - 1)), node)
        return node if kind == CONST else self.generic_visit(node)

    def is_code(self, name: str | None) -> bool:
        """A name the test leaves to the code: neither bound by its setup nor a built-in or a standard module."""
        if name in self.code_names:
            return True
        known = name in self.bound or hasattr(builtins, name or "") or name in sys.stdlib_module_names
        return name is not None and not known

    def kind(self, node: ast.expr) -> str | None:
        """What `node` is (None where it is none of them: a lambda, a `**`, an unknown call around the code's)."""
        if id(node) not in self.kinds:
            self.kinds[id(node)] = self._kind(node)
        return self.kinds[id(node)]

    def _kind(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant):
            return CONST if node.value is None or type(node.value) in (*NUMBERS, str, bytes) else None
        if isinstance(node, ast.Name):
            return CODE if self.is_code(node.id) else INPUT if node.id in self.bound else None
        if isinstance(node, ast.Call):
            return self.call(node)
        if isinstance(node, ast.Subscript):
            return self.parts([node.value, node.slice], wrap=True)
        if isinstance(node, ast.Slice):
            return self.parts([part for part in (node.lower, node.upper, node.step) if part])
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and not any(isinstance(e, ast.Starred) for e in node.elts):
            return self.parts(node.elts)
        if isinstance(node, ast.Dict) and None not in node.keys:
            return self.parts([*node.keys, *node.values])
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub, ast.UAdd)):
            return self.parts([node.operand])
        if isinstance(node, ast.BinOp) and isinstance(node.op, OPERATORS):
            return self.parts([node.left, node.right])
        if isinstance(node, ast.BoolOp):
            return self.parts(node.values)
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            same = all(_singleton(sides[i]) or _singleton(sides[i + 1]) for i, op in enumerate(node.ops)
                       if isinstance(op, (ast.Is, ast.IsNot)))  # fmt: skip
            return self.parts(sides) if same else None  # `is`: against None, True or False only
        return None

    def call(self, node: ast.Call) -> str | None:
        name, root = _dotted(node.func), _root(node.func)
        if root in self.code_names or (name not in PARENT_CALLS and self.is_code(root)):
            return CODE  # the code's call: its arguments are the task's inputs, whatever they are
        unpacked = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
        if name not in PARENT_CALLS or root in self.bound - {"math"} or unpacked:
            return None
        arguments = [*node.args, *[keyword.value for keyword in node.keywords]]
        return self.parts(arguments, wrap=name in WRAPPERS or (name in REDUCTIONS and len(arguments) == 1))

    def parts(self, children: list[ast.expr], wrap: bool = False) -> str | None:
        """The kind of an expression from its `children`'s. With `wrap` (a conversion, or indexing), one whose
        first child is the code's work and the rest literals is the code's work too: a hole, whole."""
        kinds = [self.kind(child) for child in children]
        if None in kinds:
            return None
        if all(kind == CONST for kind in kinds):
            return CONST
        if wrap and kinds[0] == CODE and all(kind == CONST for kind in kinds[1:]):
            return CODE
        if INPUT in kinds:  # the test's own data in a verdict: judged where that data is, never here
            return INPUT if CODE not in kinds and MIXED not in kinds else None
        return MIXED


@functools.lru_cache(maxsize=4096)
def split_test(test: str, entry_point: str | None = None) -> Split | str:
    """`test` split for judging here, or why it cannot be (it then runs in the completion's process). A test is
    asserts (`assert <expression>`, `assert <expression> <compare> <expected>`), after setup (imports, assignments,
    definitions); or a HumanEval-style `def check(candidate): ...` of the same, `candidate` standing for
    `entry_point`, a name the code defines. Cached: a group's completions share their tests."""
    try:
        module = ast.parse(test)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "it does not parse"
    checks = [s for s in module.body if isinstance(s, ast.FunctionDef) and s.name == "check"]
    statements, prefix, code_names = module.body, [], {entry_point} - {None}
    if checks:
        if not entry_point or not entry_point.isidentifier():
            return "it defines check(candidate), and the row names no entry_point (the function it checks)"
        called = [s for s in module.body if isinstance(s, ast.Expr) and _root(s.value) == "check"]
        prefix = [s for s in module.body if s is not checks[-1] and s not in called]
        statements, code_names = checks[-1].body, code_names | {"candidate"}
    setup, asserts = _setup_and_asserts(prefix, statements)
    if asserts is None:
        return setup
    bound = {name for statement in setup for name in _bound(statement)} - code_names
    splitter = _Splitter(bound, code_names)
    conditions = []
    for each in asserts:
        before = len(splitter.holes)
        conditions.append(splitter.condition(each.test))
        calls = any(isinstance(node, ast.Call) for node in ast.walk(each.test))
        if conditions[-1] is None:
            return "an assert's expected side needs more than literals, or its checked side is not the code's call"
        if calls and len(splitter.holes) == before:  # `sum(10, 15) == 6` tests the code's own `sum`
            return "an assert calls no name of the code's (one named as a built-in?), and the row names no entry_point"
    lines = [ast.unparse(statement) for statement in setup]
    if checks:
        lines.append(f"candidate = {entry_point}")
    return Split("\n".join(lines), tuple(splitter.holes), tuple(conditions))


def _setup_and_asserts(prefix: list[ast.stmt], body: list[ast.stmt]) -> tuple[Any, list[ast.Assert] | None]:
    """(setup statements, asserts) of a test, or (why not, None): setup first, then asserts (and docstrings)."""
    setup, asserts = list(prefix), []
    for statement in body:
        docstring = isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
        if isinstance(statement, ast.Assert):
            asserts.append(statement)
        elif isinstance(statement, (ast.Import, ast.ImportFrom)) or (isinstance(statement, SETUP) and not asserts):
            setup.append(statement)
        elif not docstring:
            return f"it holds a statement other than setup and asserts (`{type(statement).__name__}`)", None
    if not all(isinstance(s, SETUP) or isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) for s in setup):
        return "its setup does more than import, assign and define", None
    if any(isinstance(node, (ast.Assert, ast.Raise)) for s in setup for node in ast.walk(s)):
        return "its setup asserts or raises (a verdict of its own)", None
    if any(isinstance(s, ast.ImportFrom) and s.names[0].name == "*" for s in setup):
        return "its setup imports `*` (which names are the code's cannot be told)", None
    return setup, asserts


def _bound(statement: ast.stmt) -> list[str]:
    """The names a setup statement binds."""
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return [(alias.asname or alias.name).split(".")[0] for alias in statement.names]
    if isinstance(statement, (ast.FunctionDef, ast.ClassDef)):
        return [statement.name]
    targets = statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", None)]
    return [node.id for target in targets if target for node in ast.walk(target) if isinstance(node, ast.Name)]


def judge(condition: ast.expr, values: list[Any]) -> bool:
    """Whether `condition` (a `Split`'s) holds with its holes' `values`; False where judging it raises (a str
    compared with an int, a forged set of a list, ...)."""
    try:
        return bool(_evaluate(condition, values))
    except Exception:  # the values are the code's: whatever they make the verdict raise, the test fails
        return False


def _evaluate(node: ast.expr, values: list[Any]) -> Any:
    """`node` of the grammar `_Splitter` admits, on plain values: nothing but literals, `PARENT_CALLS` and
    operators, arithmetic on numbers only (so no value makes it build a huge object)."""
    recurse = functools.partial(_evaluate, values=values)
    if isinstance(node, ast.Constant):
        return values[node.value.index] if isinstance(node.value, Slot) else node.value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](map(recurse, node.elts))
    if isinstance(node, ast.Dict):
        return dict(zip(map(recurse, node.keys), map(recurse, node.values), strict=True))
    if isinstance(node, ast.Call):
        keywords = {keyword.arg: recurse(keyword.value) for keyword in node.keywords}
        return PARENT_CALLS[_dotted(node.func)](*map(recurse, node.args), **keywords)
    if isinstance(node, ast.Subscript):
        return recurse(node.value)[recurse(node.slice)]
    if isinstance(node, ast.Slice):
        return slice(*(recurse(part) if part else None for part in (node.lower, node.upper, node.step)))
    if isinstance(node, ast.BoolOp):
        found = [bool(recurse(value)) for value in node.values]
        return all(found) if isinstance(node.op, ast.And) else any(found)
    if isinstance(node, ast.UnaryOp):
        operand = recurse(node.operand)
        if isinstance(node.op, ast.Not):
            return not operand
        return _number(operand) if isinstance(node.op, ast.UAdd) else -_number(operand)
    if isinstance(node, ast.BinOp):
        return _arithmetic(node.op, _number(recurse(node.left)), _number(recurse(node.right)))
    if isinstance(node, ast.Compare):
        sides = [recurse(node.left), *map(recurse, node.comparators)]
        return all(_compare(op, sides[i], sides[i + 1]) for i, op in enumerate(node.ops))
    raise TypeError(f"{type(node).__name__} is not judged here")


def _number(value: Any) -> Any:
    if type(value) not in NUMBERS:
        raise TypeError("arithmetic on numbers only")
    return value


def _arithmetic(op: ast.operator, left: Any, right: Any) -> Any:
    return {
        ast.Add: lambda: left + right,
        ast.Sub: lambda: left - right,
        ast.Mult: lambda: left * right,
        ast.Div: lambda: left / right,
        ast.FloorDiv: lambda: left // right,
        ast.Mod: lambda: left % right,
    }[type(op)]()


def _compare(op: ast.cmpop, left: Any, right: Any) -> bool:
    return {
        ast.Eq: lambda: left == right,
        ast.NotEq: lambda: left != right,
        ast.Lt: lambda: left < right,
        ast.LtE: lambda: left <= right,
        ast.Gt: lambda: left > right,
        ast.GtE: lambda: left >= right,
        ast.In: lambda: left in right,
        ast.NotIn: lambda: left not in right,
        ast.Is: lambda: left is right,
        ast.IsNot: lambda: left is not right,
    }[type(op)]()
