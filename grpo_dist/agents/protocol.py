"""The environment protocol: how an agentic task talks to the rollout.

An environment is a class (its dotted path in `environment.name`, or the built-in `tools`) built once per trajectory
with `environment.kwargs`:

- `reset(row) -> messages`: the first chat messages from the data row (`row["messages"]`: the row's turns, its
  system prompt first; the row's other fields beside it);
- `step(turn) -> Observation`: given the model's turn (its text and its tool calls, already run in the sandbox with
  their results or errors), the messages the model reads next, optional reward parts, and whether the episode is
  done.

The base class answers every tool call with a `tool` message holding its result or error and ends the episode at
the first turn without a tool call: the plain tool-use loop. Subclasses override either method; neither may block
for long (they run in the generator, between engine calls: slow work belongs in a tool).

Every tool call of a trajectory has an id unique within it (the model's own, or `call_<n>`): the assistant message
lists its calls with their ids and each `tool` message names the call it answers (`tool_call_id`).

An exception raised by the environment (its constructor, `reset`, `step`, or reading what they return), by a tool
parser of your own, or by an agent fails that trajectory alone (`UserCodeError`): it holds no tokens, is unscored,
counted in `agent/failed`, and the run's first such failure is printed.

Also here, the messages between a trajectory's loop and what samples it (the generator's engine, or an agent's
chat-completions endpoint): `Sampled`, `Sampler`, `Limits` and the finished `Trajectory`.
"""

from __future__ import annotations

import importlib
import itertools
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from grpo_dist.types import Episode


@dataclass
class ToolCall:
    """One tool call read from a model turn, and what came of it."""

    name: str
    """The tool asked for ("" when the call could not be read)."""
    arguments: dict[str, Any] = field(default_factory=dict)
    """Its keyword arguments, as the model wrote them."""
    result: str | None = None
    """What the tool returned, as text; None when it has an error."""
    error: str | None = None
    """Why there is no result: the call was malformed, named no tool, had wrong arguments, raised or timed out."""
    seconds: float = 0.0
    """Wall time the tool took."""
    id: str | None = None
    """The call's id, which its result's `tool` message carries as `tool_call_id`: the model's own when it wrote
    one, else (or when the trajectory already used it) one assigned by the episode, `call_<n>`, unique within the
    trajectory (`assign_call_ids`)."""


def assign_call_ids(calls: list[ToolCall], taken: set[str]) -> None:
    """Give each call without an id, or with one already in `taken` (the ids of the trajectory so far), the first
    free `call_<n>`; every call's id is then added to `taken`."""
    for call in calls:
        if not call.id or call.id in taken:
            call.id = next(f"call_{number}" for number in itertools.count() if f"call_{number}" not in taken)
        taken.add(call.id)


@dataclass
class Turn:
    """The model's turn, as the environment's `step` sees it."""

    text: str
    """The turn decoded, special tokens skipped."""
    tool_calls: list[ToolCall]
    """The calls read from it, in order, each with its result or error."""
    number: int
    """1 for the model's first turn."""


@dataclass
class Observation:
    """What the environment answers a turn with."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    """Chat messages the model reads next (e.g. `{"role": "tool", "content": ...}`); ignored when `done`."""
    done: bool = False
    """The episode is over: the turn just sampled is the model's last."""
    reward: dict[str, float] = field(default_factory=dict)
    """Optional reward parts for this turn, summed per name over the episode; the reward functions receive their
    total as `environment_reward` (the built-in reward `environment` returns it)."""


def tool_message(call: ToolCall) -> dict[str, str]:
    """The `tool` message answering one call: its result, or `error: ...`, with the call's id when it has one."""
    content = call.result if call.error is None else f"error: {call.error}"
    return {"role": "tool", "name": call.name, "content": content} | ({"tool_call_id": call.id} if call.id else {})


def assistant_message(text: str, calls: list[ToolCall]) -> dict[str, Any]:
    """The model's turn as a chat message: its text and, when it called tools, each call with its id in the OpenAI
    shape (so each `tool` message's `tool_call_id` names the call it answers)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments, default=str)},
            }
            for call in calls
        ]
    return message


class UserCodeError(Exception):
    """The user's code (an environment's constructor, `reset` or `step`, a tool parser, an agent) raised: its
    trajectory fails alone. `reason`: `<where> raised <type>: <the first line of its message>`."""

    def __init__(self, where: str, error: BaseException) -> None:
        lines = str(error).strip().splitlines()
        self.reason = f"{where} raised {type(error).__name__}" + (f": {lines[0][:300]}" if lines else "")
        super().__init__(self.reason)


USER_CODE_ERRORS = (Exception, SystemExit)
"""What user code may raise without stopping the run (a `sys.exit()` included; not a cancellation, nor Ctrl-C)."""


class Environment:
    """The plain tool-use loop (the built-in environment `tools`). `tools`: the tools it offers, by built-in name or
    dotted path, when `environment.tools` does not name them."""

    tools: tuple[str, ...] = ()

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """The row's own turns."""
        return [dict(message) for message in row["messages"]]

    def step(self, turn: Turn) -> Observation:
        """Each tool call answered by its result or error; done at a turn without one."""
        if not turn.tool_calls:
            return Observation(done=True)
        return Observation([tool_message(call) for call in turn.tool_calls])


def resolve_named(name: str, builtins: dict[str, Any], what: str) -> Any:
    """The built-in `name` of `builtins`, or what the dotted path `name` ('package.module.attribute') imports;
    a `ValueError` naming `what` it was to be, and why it is not, otherwise."""
    if name in builtins:
        return builtins[name]
    module_name, _, attribute = name.rpartition(".")
    if not module_name:
        raise ValueError(
            f"{what} {name!r}: not a built-in ({', '.join(builtins)}) nor a dotted path 'package.module.attribute'"
        )
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{what} {name!r}: cannot import it ({type(error).__name__}: {error})") from error


def environment_class(name: str) -> type[Environment]:
    """The environment `name`: `tools` (the base class), or the `Environment` subclass at that dotted path."""
    found = resolve_named(name, {"tools": Environment}, "environment.name")
    if not (isinstance(found, type) and issubclass(found, Environment)):
        raise ValueError(
            f"environment.name {name!r}: not `tools` nor the dotted path of a grpo_dist.agents.Environment subclass"
        )
    return found


@dataclass
class Sampled:
    """One engine request's output (generator -> episode)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    versions: list[int]  # the weight versions that sampled its tokens


@dataclass
class Trajectory:
    """A finished trajectory, before the generator makes it a `Completion`."""

    prompt_token_ids: list[int]  # [P] the first messages rendered
    token_ids: list[int]  # [T] turns and observations, in order
    logprobs: list[float]  # [T] sampling logprob of each sampled token, 0 on observation tokens
    mask: list[int]  # [T] 1 on sampled tokens, 0 on observation tokens
    text: str  # the model's last turn
    finish_reason: str  # `stop`: the environment said done; `length`: cut; `failed`: user code raised
    versions: list[int]
    episode: Episode


@dataclass
class Limits:
    max_turns: int
    max_total_tokens: int  # prompt, turns and observations
    max_new_tokens: int  # per turn


Sampler = Callable[[list[int], int, int | None], Awaitable[Sampled]]
"""(prefix token ids, max new tokens, seed) -> the engine's turn."""
