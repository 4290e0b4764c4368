"""What `math_answer` refuses to parse: a cheap look at a completion's text before math-verify (sympy, under an
ANTLR LaTeX grammar) gets it, so that no completion costs more than a fraction of a second to judge.

math-verify evaluates what it parses: `9^9^9^9` or `\\boxed{(10^{10})!}` asks sympy for a number of billions of
digits, and the grammar's prediction grows steeply with nesting (20 nested parentheses in a `\\boxed{}` take seconds,
50 braces longer than `reward.timeout_s`). A completion that wrote such an answer would run the reward out of its
time and, were a failure cheaper than a wrong answer, be paid for it. `refusal` names what it will not parse; the
completion then scores 0, a wrong answer, which it is: no correct answer to a dataset's question is a tower of
powers or a factorial of ten billion. The bounds are on the whole completion, so a reasoning text that nests deeper
than `MAX_DEPTH` is refused too (no natural mathematics does).
"""

from __future__ import annotations

import re

MAX_CHARS = 200_000
"""Longest completion parsed: past any recipe's `rollout.max_new_tokens` (dapo's 20480 tokens)."""
MAX_DEPTH = 8
"""Deepest nesting of brackets ((, [ and {, counted together) parsed: `\\boxed{\\frac{\\sqrt{2}}{2}}` nests 3."""
MAX_BOXED = 1_000
"""Longest `\\boxed{...}` content parsed (a sum of 5000 ones there takes a second to parse)."""
MAX_DIGITS = 100_000
"""Fewest digits of a numeric power refused, as its base's digits times the least exponent with as many digits as
its exponent: `9^{99999}` (1 x 10^4) is parsed, `9^{999999}` (1 x 10^5) is not."""
MAX_FACTORIAL_DIGITS = 4
"""Most digits the number under a factorial may have: `9999!` is parsed, `10000!` is not."""

OPENERS, CLOSERS = "([{", ")]}"
POWER = re.compile(r"\^|\*\*")
NUMERIC = re.compile(r"(?:[\d\s.,+\-*/^!()\[\]{}]|\\(?:cdot|times|left|right|div|[,;! ]))*")
"""Arithmetic on numbers alone (what sympy evaluates at once): digits, operators, brackets, LaTeX's products and
spaces. Anything with a letter in it (`x^{100000}`, `e^{-x^2}`) stays symbolic and cheap."""
BOXED = re.compile(r"\\boxed\s*\{")


def refusal(text: str) -> str | None:
    """Why `math_answer` will not parse `text` (it scores 0), or None. Linear in the text's length."""
    if len(text) > MAX_CHARS:
        return f"longer than {MAX_CHARS} characters"
    depth = nesting(text)
    if depth > MAX_DEPTH:
        return f"brackets nested {depth} deep, beyond {MAX_DEPTH}"
    for found in BOXED.finditer(text):
        if len(group_after(text, found.end() - 1)) > MAX_BOXED + 2:
            return f"a \\boxed{{}} of more than {MAX_BOXED} characters"
    for found in POWER.finditer(text):
        why = _power(text, found.start(), found.end())
        if why is not None:
            return why
    for found in re.finditer(r"(?<!\\)!", text):
        operand = group_before(text, found.start())
        if is_numeric(operand) and (POWER.search(operand) or "!" in operand or _digits(operand) > MAX_FACTORIAL_DIGITS):
            return f"the factorial of {operand[:40]!r}"
    return None


def nesting(text: str) -> int:
    """The deepest nesting of brackets in `text` (a closer without its opener counts as none)."""
    depth = deepest = 0
    for char in text:
        if char in OPENERS:
            depth += 1
            deepest = max(deepest, depth)
        elif char in CLOSERS:
            depth = max(0, depth - 1)
    return deepest


def _power(text: str, start: int, end: int) -> str | None:
    """Why the power whose operator spans `text[start:end]` is refused: its exponent is numeric and holds a power or a
    factorial, is followed by one (`9^9^9`), or makes a number of more than `MAX_DIGITS` digits."""
    at = _skip_spaces(text, end)
    exponent = group_after(text, at)
    if not is_numeric(exponent):
        return None
    after = _skip_spaces(text, at + len(exponent))
    shown = repr(text[max(0, start - 10) : after + 10])
    if POWER.search(exponent) or "!" in exponent or text.startswith("!", after) or _numeric_power_at(text, after):
        return f"a tower of powers: {shown}"
    base = group_before(text, start)
    if is_numeric(base) and _digits(base) * 10 ** (min(_digits(exponent), 20) - 1) >= MAX_DIGITS:
        return f"a power of more than {MAX_DIGITS} digits: {shown}"
    return None


def _numeric_power_at(text: str, index: int) -> bool:
    """Whether a power operator with a numeric exponent starts at `index` (the next storey of a tower)."""
    found = POWER.match(text, index)
    if found is None:
        return False
    return is_numeric(group_after(text, _skip_spaces(text, found.end())))


def group_after(text: str, index: int) -> str:
    """The operand that starts at `index`: a bracketed group (to its closer, or the text's end), else a run of
    letters, digits and dots (a LaTeX command with its name), else nothing."""
    if index >= len(text):
        return ""
    if text[index] in OPENERS:
        depth = 0
        for position in range(index, len(text)):
            depth += (text[position] in OPENERS) - (text[position] in CLOSERS)
            if depth == 0:
                return text[index : position + 1]
        return text[index:]
    found = re.compile(r"\\?[\w.]+").match(text, index)
    return found.group() if found else ""


def group_before(text: str, index: int) -> str:
    """The operand that ends just before `index`: a bracketed group, or a run of letters, digits and dots."""
    if index == 0:
        return ""
    if text[index - 1] in CLOSERS:
        depth = 0
        for position in range(index - 1, -1, -1):
            depth += (text[position] in CLOSERS) - (text[position] in OPENERS)
            if depth == 0:
                return text[position:index]
        return text[:index]
    start = index
    while start > 0 and (text[start - 1].isalnum() or text[start - 1] in "._"):
        start -= 1
    return text[start:index]


def is_numeric(operand: str) -> bool:
    """Whether `operand` is arithmetic on numbers alone (`NUMERIC`) with at least one digit."""
    return any(char.isdigit() for char in operand) and NUMERIC.fullmatch(operand) is not None


def _digits(operand: str) -> int:
    return sum(char.isdigit() for char in operand)


def _skip_spaces(text: str, index: int) -> int:
    while index < len(text) and text[index] == " ":
        index += 1
    return index
