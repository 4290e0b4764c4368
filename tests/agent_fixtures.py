"""Tools, parsers and environments the agent tests name by dotted path (imported in tool sandboxes and generators)."""

from __future__ import annotations

import json
import os
import time

from grpo_dist.agents import Environment, Observation, ToolCall, Turn

NAP_MARK = "/tmp/grpo_dist_test_first_nap"
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
