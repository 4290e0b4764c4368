"""Tools, parsers and environments the agent tests name by dotted path (imported in tool sandboxes and generators)."""

from __future__ import annotations

import json
import os
import sys
import time

from grpo_dist.agents import Environment, Observation, ToolCall, Turn

NAP_DIR = "/tmp/grpo_dist_test_nap"
"""Where `nap` leaves its mark: a directory anyone may write, which the test makes and names in the environment's
`sandbox_paths` (the tool sandboxes' own /tmp is private to each)."""
NAP_MARK = f"{NAP_DIR}/first_nap"
"""Created by the first `nap` call on this machine: that call sleeps `NAP_S`, every later one returns at once."""
NAP_S = 6.0


def echo(text: str) -> str:
    """Return the text given."""
    return f"echo {text}"


def nap(seconds: float = NAP_S) -> str:
    """Sleep `seconds` if no call has yet on this machine (the first call is the slow one), else return at once."""
    try:
        os.close(os.open(NAP_MARK, os.O_CREAT | os.O_EXCL, 0o666))
    except FileExistsError:
        return "awake"
    time.sleep(seconds)
    return "slept"


def sleep(seconds: float) -> str:
    """Sleep `seconds`."""
    time.sleep(seconds)
    return "slept"


def always_echo(text: str) -> list[ToolCall]:
    """Whatever a random model writes, it calls `echo` with its turn's first 8 characters (so a random-init model
    has multi-turn episodes)."""
    return [ToolCall("echo", {"text": text[:8]})]


def always_nap(text: str) -> list[ToolCall]:
    return [ToolCall("nap", {})]


class CountingEnvironment(Environment):
    """Every turn gets the tools' answers and a reward part of 0.25; done after `turns` turns; `system`: a system
    message of its own first."""

    tools = ("agent_fixtures.echo",)

    def __init__(self, turns: int = 2, system: str | None = None) -> None:
        super().__init__()
        self.turns, self.system = turns, system

    def reset(self, row: dict) -> list[dict]:
        return [{"role": "system", "content": self.system}] * bool(self.system) + row["messages"]

    def step(self, turn: Turn) -> Observation:
        done = turn.number >= self.turns
        messages = [{"role": "tool", "content": call.result or f"error: {call.error}"} for call in turn.tool_calls]
        return Observation(messages, done=done, reward={"step": 0.25})


async def calculator_agent(client, row: dict) -> dict:
    """An agent written against the `openai` client: asks the model, runs each tool call it makes with the
    calculator (here, not in a sandbox: an agent runs its own tools), sends the results back, up to three calls;
    rewarded 1 per reply that asked for a tool."""
    from grpo_dist.agents.tools import calculator

    messages = [{"role": "user", "content": row["messages"][-1]["content"]}]
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    asked = 0
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=tools, max_tokens=90)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        asked += 1
        for call in message.tool_calls:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except Exception as error:
                result = f"error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return {"asked": float(asked)}


async def rewriting_agent(client, row: dict) -> None:
    """Calls twice, the second time with a history it rewrote (its first reply replaced)."""
    messages = [{"role": "user", "content": row["messages"][-1]["content"]}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    rewritten = [*messages, {"role": "user", "content": "again"}]
    await client.chat.completions.create(model="policy", messages=rewritten, max_tokens=8)


def hermes_and_sleep(text: str) -> list[ToolCall]:
    """The Hermes calls of a turn and, when it has any, a call to `sleep` for 3 s after them (slow tools: a weight
    update lands while trajectories wait on them)."""
    from grpo_dist.agents.parsers import hermes

    calls = hermes(text)
    return [*calls, ToolCall("sleep", {"seconds": 3.0})] if calls else calls


# User code that raises: each fails its own trajectory, never the run.


class RaisingEnvironment(CountingEnvironment):
    """`CountingEnvironment` failing where `fail_in` says: `init` (its constructor, every trajectory), and for rows
    whose `fail` field is true `reset`, `messages` (first messages without a role), `step`, `reward` (a reward part
    that is not a number) or `exit` (`sys.exit` in `step`)."""

    def __init__(self, fail_in: str, turns: int = 2) -> None:
        if fail_in == "init":
            raise RuntimeError("cannot connect to the task server\nTraceback line that is not shown")
        super().__init__(turns)
        self.fail_in = fail_in

    def reset(self, row: dict) -> list[dict]:
        self.failing = bool(row.get("fail"))
        if self.failing and self.fail_in == "reset":
            raise KeyError("question")
        if self.failing and self.fail_in == "messages":
            return [{"content": "a message without a role"}]
        return super().reset(row)

    def step(self, turn: Turn) -> Observation:
        if self.failing and self.fail_in == "step":
            raise ValueError(f"turn {turn.number} is not what I expected")
        if self.failing and self.fail_in == "exit":
            raise SystemExit(3)
        observation = super().step(turn)
        if self.failing and self.fail_in == "reward":
            observation.reward = {"step": "plenty"}
        return observation


def raising_parser(text: str) -> list[ToolCall]:
    raise RuntimeError("the parser's own bug")


def echo_twice(text: str) -> list[ToolCall]:
    """Two `echo` calls per turn: the first without an id, the second with the id `mine` the model gave it (taken
    after the first turn, so renamed)."""
    return [ToolCall("echo", {"text": f"{text[:3]}-1"}), ToolCall("echo", {"text": f"{text[:3]}-2"}, id="mine")]


async def one_call_agent(client, row: dict) -> float:
    """Asks the model once; rewarded 1."""
    messages = [{"role": "user", "content": row["messages"][-1]["content"]}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    return 1.0


async def raising_agent(client, row: dict) -> float:
    """Asks the model once, then, for a row whose `fail` is true, raises (its own bug)."""
    await one_call_agent(client, row)
    if row.get("fail"):
        raise KeyError("the reply has no answer")
    return 1.0


async def exiting_agent(client, row: dict) -> float:
    """Calls `sys.exit(2)` for a row whose `fail` is true, before asking anything."""
    if row.get("fail"):
        sys.exit(2)
    return await one_call_agent(client, row)


async def silent_agent(client, row: dict) -> float:
    """For a row whose `fail` is true, never asks the model: there is nothing to train on."""
    return 1.0 if row.get("fail") else await one_call_agent(client, row)


async def wordy_agent(client, row: dict) -> float | dict:
    """Asks the model once; for a row whose `fail` is true, returns a reward that is not a number."""
    await one_call_agent(client, row)
    return {"answer": "correct"} if row.get("fail") else 1.0


def flood(megabytes: int) -> str:
    """Return `megabytes` MB of text."""
    return "x" * (megabytes << 20)


class ThreadNotingEnvironment(CountingEnvironment):
    """A `CountingEnvironment` that notes the thread each `step` runs on (`stepped_on`)."""

    stepped_on: list[str] = []

    def step(self, turn: Turn) -> Observation:
        import threading

        ThreadNotingEnvironment.stepped_on.append(threading.current_thread().name)
        return super().step(turn)
