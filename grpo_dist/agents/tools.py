"""Tools: plain Python functions, offered to the model with a JSON schema and run in a sandbox process.

A tool is named by a built-in name (`calculator`) or the dotted path of a function (`my_pkg.tools.search`). Its
schema is read from the function: the name, the first paragraph of the docstring as the description, and one
parameter per argument, typed by its annotation (`str`, `int`, `float`, `bool`, `list`, `dict`); arguments with no
default are required. A function may carry its own `schema` attribute (the OpenAI `function` object) instead.

The `ToolBox` checks each call against the schema (unknown tool, missing, unexpected or mistyped arguments: an
error the model reads) and runs the rest in sandbox processes of the generator (`grpo_dist.sandbox`: no network,
limited memory, no processes), as many at once as `environment.tool_workers` (more wait for a free sandbox), each
call bounded by `environment.tool_timeout_s` (past it the sandbox is killed with everything it started, and the
call answered with a time-out error). The built-in `python` tool runs the model's code, so each of its calls runs
in a jail of its own instead (`grpo_dist.rewards.code`). A tool returns anything; what the model reads is its text
(a `str` as is, anything else as JSON), at most `RESULT_LIMIT` characters of it.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import math
import operator
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from grpo_dist.agents.protocol import ToolCall, resolve_named
from grpo_dist.rewards.code import run_python
from grpo_dist.sandbox import Sandbox
from grpo_dist.sandbox.jail import Isolation

JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
PYTHON_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Exponents above 64 and numbers longer than 400 digits are refused, so no call runs for long.
    """
    operators = {
        ast.Add: operator.add,
        ast.Sub: operator.sub,
        ast.Mult: operator.mul,
        ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod,
        ast.Pow: operator.pow,
    }

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in operators:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError(f"exponent {right} is above 64")
            found = operators[type(node.op)](left, right)
            if isinstance(found, int) and len(str(abs(found))) > 400:
                raise ValueError("the result has more than 400 digits")
            return found
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")

    found = value(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(found, float) and math.isfinite(found) and found.is_integer():
        found = int(found)
    return str(found)


def python(code: str) -> str:
    """Run Python code in a fresh interpreter and read what it prints (its traceback if it raises).

    Each call starts anew (nothing is kept between calls), jailed: no network, no files of the machine, no packages
    beyond the standard library (README: Sandbox).
    """
    return run_python(code, PYTHON_TIMEOUT_S, Isolation.REQUIRE)


PYTHON_TIMEOUT_S = 10.0  # when called outside a ToolBox, which gives it `environment.tool_timeout_s`
RESULT_LIMIT = 32768  # characters of a tool's result the model reads (`cut`)
BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator, "python": python}


def resolve_tool(name: str) -> Callable[..., Any]:
    """The built-in tool `name`, or the function at dotted path `name`; `ValueError` naming what is wrong."""
    function = resolve_named(name, BUILTIN_TOOLS, "tool")
    if not callable(function):
        raise ValueError(f"tool {name!r} is a {type(function).__name__}, not a function")
    return function


@dataclass(frozen=True)
class ToolSpec:
    """A tool as offered to the model: how it is imported, and its schema."""

    path: str
    """Its built-in name or dotted path (what the sandbox imports)."""
    schema: dict[str, Any]
    """The OpenAI function object: `{"name", "description", "parameters"}` (a JSON schema of the arguments)."""

    @property
    def name(self) -> str:
        return self.schema["name"]

    @property
    def chat_template_entry(self) -> dict[str, Any]:
        """What a chat template's `tools` list holds for it."""
        return {"type": "function", "function": self.schema}


def tool_spec(path: str) -> ToolSpec:
    """The spec of the tool at `path`, its schema read from the function (or its `schema` attribute)."""
    function = resolve_tool(path)
    if isinstance(getattr(function, "schema", None), dict):
        return ToolSpec(path, function.schema)
    properties, required = {}, []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        annotation = parameter.annotation
        if isinstance(annotation, str):  # `from __future__ import annotations`
            annotation = {cls.__name__: cls for cls in JSON_TYPES}.get(annotation, annotation)
        properties[parameter.name] = {"type": JSON_TYPES[annotation]} if annotation in JSON_TYPES else {}
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    description = (inspect.getdoc(function) or "").split("\n\n")[0].replace("\n", " ")
    parameters = {"type": "object", "properties": properties, "required": required}
    return ToolSpec(path, {"name": function.__name__, "description": description, "parameters": parameters})


def argument_error(spec: ToolSpec, arguments: dict[str, Any]) -> str | None:
    """Why `arguments` do not fit the tool's schema (missing, unexpected or mistyped), or None."""
    parameters = spec.schema.get("parameters", {})
    properties = parameters.get("properties", {})
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    if missing:
        return f"{spec.name}: missing argument {', '.join(map(repr, missing))}"
    unexpected = [name for name in arguments if name not in properties]
    if unexpected and parameters.get("additionalProperties", False) is not True:
        return f"{spec.name}: unexpected argument {', '.join(map(repr, unexpected))}; it takes {list(properties)}"
    for name, value in arguments.items():
        expected = properties.get(name, {}).get("type")
        if expected in PYTHON_TYPES and not isinstance(value, PYTHON_TYPES[expected]):
            return f"{spec.name}: argument {name!r} must be a JSON {expected}, got {json.dumps(value)}"
    return None


def cut(result: str | None) -> str | None:
    """A tool's result as the model reads it: at most `RESULT_LIMIT` characters, saying where it was cut (the
    observation is tokenized whole, and no trajectory has room for more)."""
    if result is None or len(result) <= RESULT_LIMIT:
        return result
    return result[:RESULT_LIMIT] + f"\n[result cut: {len(result)} characters, the first {RESULT_LIMIT} shown]"


class ToolBox:
    """Runs a trajectory's tool calls in the generator's tool sandboxes (`workers` processes, started when first
    needed), each call bounded by `timeout_s`. Calls of one turn run one after the other; trajectories' calls run
    at once, up to `workers`."""

    def __init__(self, specs: list[ToolSpec], limits: Any, workers: int, timeout_s: float) -> None:
        self.specs = {spec.name: spec for spec in specs}
        self.paths = [spec.path for spec in specs]  # what a sandbox imports, in call-index order
        self.index = {spec.name: number for number, spec in enumerate(specs)}
        self.limits, self.timeout_s = limits, timeout_s
        self.idle: asyncio.Queue | None = None  # sandboxes not in use (None: a slot to start one in)
        self.workers = workers
        self.sandboxes: list[Any] = []
        self.threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tools")  # one per sandbox

    async def run(self, calls: list[ToolCall]) -> None:
        """Give each call its result or error, in order (a call already holding an error, a malformed one, is kept)."""
        for call in calls:
            if call.error is not None:
                continue
            spec = self.specs.get(call.name)
            if spec is None:
                call.error = f"no tool {call.name!r}; the tools are {', '.join(self.specs) or 'none'}"
            elif (why := argument_error(spec, call.arguments)) is not None:
                call.error = why
            else:
                await self._call(self.index[call.name], call)

    async def _call(self, index: int, call: ToolCall) -> None:
        """Run one call in an idle sandbox (started first if need be). A trajectory cancelled meanwhile leaves the
        call to finish on its thread; its sandbox is idle again only then."""
        if self.idle is None:
            self.idle = asyncio.Queue()
            for _ in range(self.workers):
                self.idle.put_nowait(None)
        sandbox = await self.idle.get()
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        running = asyncio.ensure_future(loop.run_in_executor(self.threads, self._run, sandbox, index, call.arguments))
        running.add_done_callback(lambda done: self.idle.put_nowait(None if done.exception() else done.result()[0]))
        try:
            _, call.result, call.error = await asyncio.shield(running)
        finally:
            call.seconds = time.monotonic() - started

    def _run(self, sandbox: Any, index: int, arguments: dict[str, Any]) -> tuple[Any, str | None, str | None]:
        from grpo_dist.config import MODEL_CODE_TOOLS  # here: the sandbox's server imports this module without it

        if self.paths[index] in MODEL_CODE_TOOLS:
            isolation = Isolation.REQUIRE if self.limits.require else Isolation.BEST_EFFORT
            try:
                return sandbox, run_python(arguments["code"], self.timeout_s, isolation), None
            except Exception as error:  # isolation refused on this node: the call fails, not the trajectory
                return sandbox, None, f"{type(error).__name__}: {error}"
        if sandbox is None:
            sandbox = self._start()
        result, error = sandbox.call_tool(index, arguments, self.timeout_s)
        return sandbox, cut(result), error

    def _start(self) -> Sandbox:
        sandbox = Sandbox(self.paths, self.limits, kind="tools")
        self.sandboxes.append(sandbox)
        return sandbox

    def close(self) -> None:
        for sandbox in self.sandboxes:
            sandbox.close()
        self.threads.shutdown(wait=False, cancel_futures=True)
