"""Reading tool calls out of a model turn. A parser is `(text) -> list[ToolCall]`: a call it cannot read comes back
with `error` set (the model reads the error and may try again), never as an exception.

- `hermes` (the format of Qwen2.5, Hermes and many others): each call is a JSON object
  `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, with an `"id"` when the model
  writes one (else the episode assigns it one, unique within the trajectory).
- `none`: the model calls no tools (every turn ends the episode with the base environment).
- A dotted path names a function of your own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from grpo_dist.agents.protocol import ToolCall, resolve_named

Parser = Callable[[str], list[ToolCall]]

HERMES_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def hermes(text: str) -> list[ToolCall]:
    """Every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in `text`, in order."""
    calls = []
    for match in HERMES_CALL.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            calls.append(ToolCall("", error="a <tool_call> without its </tool_call>"))
            continue
        calls.append(_read_call(body))
    return calls


def _read_call(body: str) -> ToolCall:
    try:
        found = json.loads(body)
    except json.JSONDecodeError as error:
        return ToolCall("", error=f"the tool call is not JSON ({error.msg} at character {error.pos}): {body[:200]}")
    if not isinstance(found, dict) or not isinstance(found.get("name"), str):
        return ToolCall("", error='a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    arguments = found.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    given = found["id"] if isinstance(found.get("id"), str) and found["id"] else None  # the model's own id, if any
    if not isinstance(arguments, dict):
        return ToolCall(found["name"], error="the tool call's arguments must be a JSON object", id=given)
    return ToolCall(found["name"], arguments, id=given)


def no_tools(text: str) -> list[ToolCall]:
    return []


PARSERS: dict[str, Parser] = {"hermes": hermes, "none": no_tools}


def resolve_parser(name: str) -> Parser:
    """The built-in parser `name`, or the function at dotted path `name`; `ValueError` naming what is wrong."""
    return resolve_named(name, PARSERS, "environment.tool_parser")
