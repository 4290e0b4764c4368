"""One trajectory, token in and token out.

The loop, on a generator: the environment's first messages are rendered once; each turn the engine continues from
the trajectory's exact token prefix; the turn's text is parsed for tool calls, which run in the tool sandboxes; the
environment answers with an observation, whose tokens (`Renderer.observation`) are appended, and the next turn
follows. Sampled tokens carry their sampling logprobs and a loss mask of 1; observation tokens a mask of 0. The
trajectory always ends on a model turn.

It ends when the environment says done (`finish_reason` `stop`), or is cut (`length`, `Episode.truncated`): a turn
that hit its token limit (or stopped on a token other than the end-of-sequence token the chat template ends turns
with), an observation that would leave no room under `environment.max_total_tokens`, or `environment.max_turns`
turns without done (the last turn's tool calls are then not run). Each turn is its own engine request, seeded from
the trajectory's seed and the turn, and labelled with the weight versions that sampled it; the trajectory's version
is the oldest. Each tool call gets an id unique in the trajectory (`protocol.assign_call_ids`), which the assistant
message lists and the `tool` message answering it names.

It fails (`finish_reason` `failed`, `Episode.failure`) when user code raises: the environment's constructor,
`reset` or `step` (or what they return cannot be read), a tool parser of your own, or an agent. A failed trajectory
holds no tokens, only its prompt, and is unscored (the reward pool calls no function for it): it fails alone, never
the run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from grpo_dist.agents.endpoint import Endpoint
from grpo_dist.agents.parsers import resolve_parser
from grpo_dist.agents.protocol import (
    USER_CODE_ERRORS,
    Environment,
    Limits,
    Sampler,
    ToolCall,
    Trajectory,
    Turn,
    UserCodeError,
    assign_call_ids,
    assistant_message,
    environment_class,
    resolve_named,
)
from grpo_dist.agents.render import Renderer
from grpo_dist.agents.tools import ToolBox, ToolSpec, tool_spec
from grpo_dist.config import EnvironmentConfig
from grpo_dist.sandbox import Limits as SandboxLimits
from grpo_dist.types import Episode

TURN_SEED_STRIDE = 1_000_003  # turn t of a trajectory seeded s samples with seed s + t * stride


async def run_episode(
    environment: Environment,
    row: dict[str, Any],
    renderer: Renderer,
    parser: Callable,
    tools: ToolBox,
    sample: Sampler,
    limits: Limits,
    seed: int | None,
    episode: Episode,
) -> Trajectory:
    """One trajectory in `environment` from `row`, told in `episode` as it goes. Raises
    `UserCodeError` when the environment's `reset` or `step` or the tool parser raises, or returns what cannot be
    read; `episode` then holds the conversation up to there."""
    where = type(environment).__qualname__
    messages, prompt = _guarded(f"{where}.reset", _reset, environment, row, renderer)
    tokens: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    versions: list[int] = []
    episode.messages = messages
    taken: set[str] = set()  # the ids of the trajectory's tool calls
    text, done = "", False
    for number in range(1, limits.max_turns + 1):
        room = limits.max_total_tokens - len(prompt) - len(tokens)
        if room <= 0:
            break
        turn_seed = None if seed is None else seed + number * TURN_SEED_STRIDE
        sampled = await sample(prompt + tokens, min(limits.max_new_tokens, room), turn_seed)
        tokens += sampled.token_ids
        logprobs += sampled.logprobs
        mask += [1] * len(sampled.token_ids)
        versions += sampled.versions
        text = renderer.tokenizer.decode(sampled.token_ids, skip_special_tokens=True)
        episode.turns = number
        ended = bool(sampled.token_ids) and sampled.token_ids[-1] == renderer.tokenizer.eos_token_id
        if sampled.finish_reason == "length" or not ended:
            episode.messages = [*episode.messages, assistant_message(text, [])]
            break  # cut, or stopped on another token: no observation can follow it as the template writes one
        calls = _guarded(f"tool parser {getattr(parser, '__name__', parser)}", _parse, parser, text, taken)
        episode.messages = [*episode.messages, assistant_message(text, calls)]
        if calls and number == limits.max_turns:
            break  # still calling tools at the last turn: cut
        started = time.monotonic()
        await tools.run(calls)
        episode.tool_seconds += time.monotonic() - started
        episode.tool_calls += len(calls)
        episode.tool_errors += sum(call.error is not None for call in calls)
        done, observed_messages, observed = await asyncio.to_thread(  # a long observation's tokenizing, off the loop
            _guarded, f"{where}.step", _step, environment, Turn(text, calls, number), renderer, episode.rewards
        )
        if done:
            break
        if number == limits.max_turns or len(prompt) + len(tokens) + len(observed) >= limits.max_total_tokens:
            break  # no turn may follow it
        tokens += observed
        logprobs += [0.0] * len(observed)
        mask += [0] * len(observed)
        episode.messages = [*episode.messages, *observed_messages]
    episode.truncated = not done
    return Trajectory(prompt, tokens, logprobs, mask, text, "stop" if done else "length", versions, episode)


def _guarded(where: str, function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)`, running user code: what it raises is raised as a `UserCodeError` naming `where`."""
    try:
        return function(*args)
    except USER_CODE_ERRORS as error:
        raise UserCodeError(where, error) from error


def _reset(environment: Environment, row: dict[str, Any], renderer: Renderer) -> tuple[list[dict], list[int]]:
    """The environment's first messages for `row`, and their tokens [P]."""
    messages = _messages(environment.reset(row))
    return messages, renderer.first(messages)


def _messages(found: Any) -> list[dict[str, Any]]:
    """Messages an environment returned, checked: a list of dicts, each with a str `role` (copies)."""
    messages = [dict(message) if isinstance(message, dict) else message for message in found]
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
            raise TypeError(f"returned the message {str(message)[:100]}, not a dict with a str 'role'")
    return messages


def _parse(parser: Callable, text: str, taken: set[str]) -> list[ToolCall]:
    """The tool calls of a turn, each with an id unique in the trajectory (`taken`: the ids so far)."""
    calls = list(parser(text))
    for call in calls:
        if not isinstance(call, ToolCall) or not (call.error is not None or isinstance(call.arguments, dict)):
            raise TypeError(f"returned {str(call)[:100]}, not a ToolCall with a dict of arguments or an error")
    assign_call_ids(calls, taken)
    return calls


def _step(
    environment: Environment, turn: Turn, renderer: Renderer, rewards: dict[str, float]
) -> tuple[bool, list[dict[str, Any]], list[int]]:
    """The environment's answer to `turn`: whether it is done, its messages and their tokens (none when done). Its
    reward parts are added to `rewards` once it is all read."""
    observation = environment.step(turn)
    parts = {str(name): float(value) for name, value in observation.reward.items()}
    done = bool(observation.done)
    messages = [] if done else _messages(observation.messages)
    observed = [] if done else renderer.observation(messages)
    for name, value in parts.items():
        rewards[name] = rewards.get(name, 0.0) + value
    return done, messages, observed


def _agent_rewards(found: Any) -> dict[str, float]:
    """What an agent returned, as reward parts: a dict of named numbers, a number (`agent`), or None (no parts)."""
    if found is None:
        return {}
    if isinstance(found, dict):
        return {str(name): float(value) for name, value in found.items()}
    return {"agent": float(found)}


def tool_specs(environment: EnvironmentConfig) -> list[ToolSpec]:
    """The tools offered: `environment.tools`, else the environment class's own."""
    names = environment.tools if environment.tools is not None else environment_class(environment.name).tools
    specs = [tool_spec(name) for name in names]
    twice = sorted({spec.name for spec in specs if [s.name for s in specs].count(spec.name) > 1})
    if twice:
        raise ValueError(f"environment.tools: two tools are called {', '.join(twice)}")
    return specs


class AgentLoop:
    """What runs a generator's trajectories: the environment class, the rendering of the model's chat template, the
    tool-call parser and the tool sandboxes, from `environment` (everything a config names is resolved here, so a
    wrong name fails when the loop is built)."""

    def __init__(
        self,
        environment: EnvironmentConfig,
        tokenizer: Any,
        max_new_tokens: int,
        isolation: str = "best_effort",
        sandbox_env: list[str] = (),
    ) -> None:
        """`isolation`, `sandbox_env`: `reward.isolation` and `reward.sandbox_env` (README: Sandbox)."""
        self.config = environment
        self.environment = environment_class(environment.name)
        self.specs = tool_specs(environment)
        self.renderer = Renderer(tokenizer, [spec.chat_template_entry for spec in self.specs])
        self.parser = resolve_parser(environment.tool_parser)
        limits = SandboxLimits(
            environment.sandbox_memory_mb,
            environment.tool_timeout_s,
            False,
            environment.sandbox_network,
            isolation == "require",
            tuple(sandbox_env),
            tuple(environment.sandbox_paths),
        )
        self.tools = ToolBox(self.specs, limits, environment.tool_workers, environment.tool_timeout_s)
        self.limits = Limits(environment.max_turns, environment.max_total_tokens, max_new_tokens)
        self.agent = resolve_named(environment.agent, {}, "environment.agent") if environment.agent else None
        self.endpoint = None
        if self.agent is not None:
            self.endpoint = Endpoint(tokenizer, self.parser, self.limits)

    def new_environment(self) -> Environment:
        return self.environment(**self.config.kwargs)

    def first_tokens(self, row: dict[str, Any]) -> list[int]:
        """[P] the first messages of a fresh environment for `row`, rendered (the driver's view of a prompt)."""
        return self.renderer.first(self.new_environment().reset(row))

    async def trajectory(
        self, row: dict[str, Any], sample: Sampler, seed: int | None, prompt_token_ids: list[int]
    ) -> Trajectory:
        """One trajectory from `row`: the agent's, else the environment's tool loop. Where user code raises (the
        environment, the tool parser, the agent) the trajectory fails alone: it holds no tokens (its prompt is
        `prompt_token_ids`, the driver's rendering of the row), `finish_reason` is `failed` and `episode.failure`
        says why."""
        episode = Episode()
        try:
            if self.agent is not None:
                return await self._agent_trajectory(row, sample, seed, episode)
            environment = _guarded(f"{self.environment.__qualname__}.__init__", self.new_environment)
            return await run_episode(
                environment, row, self.renderer, self.parser, self.tools, sample, self.limits, seed, episode
            )
        except UserCodeError as failure:
            episode.failure = failure.reason
            return Trajectory(list(prompt_token_ids), [], [], [], "", "failed", [], episode)

    async def _agent_trajectory(
        self, row: dict[str, Any], sample: Sampler, seed: int | None, episode: Episode
    ) -> Trajectory:
        """The user's agent run against a session of the endpoint, bounded by `environment.episode_timeout_s`.
        Raises `UserCodeError` when the agent raises, returns what is not a reward, or has no reply to train on;
        `episode` then holds the conversation the endpoint recorded."""
        import asyncio

        import openai

        base_url = self.endpoint.open(sample, seed)
        bound = self.config.episode_timeout_s
        client = openai.AsyncOpenAI(base_url=base_url, api_key=self.endpoint.api_key, max_retries=0, timeout=bound)
        found, cut = None, False
        try:
            found = await asyncio.wait_for(self._run_agent(client, row), bound)
        except TimeoutError:
            cut = True
        finally:
            session = self.endpoint.close(base_url)
            episode.messages = list(session.history)
            await client.close()
        rewards = _guarded(f"environment.agent {self.config.agent} (its return value)", _agent_rewards, found)
        if not session.mask:
            raise UserCodeError(
                f"environment.agent {self.config.agent}",
                RuntimeError(
                    "it got no reply from the model to train on (no call, or none with room under "
                    "environment.max_total_tokens)"
                ),
            )
        return session.trajectory(rewards, cut, self.config.agent)

    async def _run_agent(self, client: Any, row: dict[str, Any]) -> Any:
        """The agent's reward; what it raises (`sys.exit()` included, which a task would hand to the event loop)
        raised as a `UserCodeError`."""
        try:
            return await self.agent(client, row)
        except USER_CODE_ERRORS as error:
            raise UserCodeError(f"environment.agent {self.config.agent}", error) from error

    async def start(self) -> None:
        """Open the chat-completions endpoint, when an agent calls it."""
        if self.endpoint is not None:
            await self.endpoint.start()

    def close(self) -> None:
        """End the tools' sandboxes and wait until they are gone."""
        self.tools.close()
