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
is the oldest.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from grpo_dist.agents.parsers import resolve_parser
from grpo_dist.agents.protocol import Environment, Turn, environment_class, resolve_named
from grpo_dist.agents.render import Renderer
from grpo_dist.agents.tools import ToolBox, ToolSpec, tool_spec
from grpo_dist.config import EnvironmentConfig
from grpo_dist.types import Episode

TURN_SEED_STRIDE = 1_000_003  # turn t of a trajectory seeded s samples with seed s + t * stride


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
    finish_reason: str  # `stop`: the environment said done; `length`: cut
    versions: list[int]
    episode: Episode


@dataclass
class Limits:
    max_turns: int
    max_total_tokens: int  # prompt, turns and observations
    max_new_tokens: int  # per turn


Sampler = Callable[[list[int], int, int | None], Awaitable[Sampled]]
"""(prefix token ids, max new tokens, seed) -> the engine's turn."""


async def run_episode(
    environment: Environment, row: dict[str, Any], renderer: Renderer, parser: Callable, tools: ToolBox,
    sample: Sampler, limits: Limits, seed: int | None,
) -> Trajectory:  # fmt: skip
    messages = environment.reset(row)
    prompt = renderer.first(messages)
    tokens: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    versions: list[int] = []
    episode = Episode(messages=list(messages))
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
        episode.turns, episode.messages = number, [*episode.messages, {"role": "assistant", "content": text}]
        ended = bool(sampled.token_ids) and sampled.token_ids[-1] == renderer.tokenizer.eos_token_id
        if sampled.finish_reason == "length" or not ended:
            break  # cut, or stopped on another token: no observation can follow it as the template writes one
        calls = parser(text)
        if calls and number == limits.max_turns:
            break  # still calling tools at the last turn: cut
        started = time.monotonic()
        await tools.run(calls)
        episode.tool_seconds += time.monotonic() - started
        episode.tool_calls += len(calls)
        episode.tool_errors += sum(call.error is not None for call in calls)
        observation = environment.step(Turn(text, calls, number))
        for name, value in observation.reward.items():
            episode.rewards[name] = episode.rewards.get(name, 0.0) + float(value)
        if observation.done:
            done = True
            break
        observed = renderer.observation(observation.messages)
        if number == limits.max_turns or len(prompt) + len(tokens) + len(observed) >= limits.max_total_tokens:
            break  # no turn may follow it
        tokens += observed
        logprobs += [0.0] * len(observed)
        mask += [0] * len(observed)
        episode.messages = [*episode.messages, *observation.messages]
    episode.truncated = not done
    return Trajectory(prompt, tokens, logprobs, mask, text, "stop" if done else "length", versions, episode)


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
        self, environment: EnvironmentConfig, tokenizer: Any, max_new_tokens: int, isolation: str = "best_effort",
        sandbox_env: list[str] = (),
    ) -> None:  # fmt: skip
        """`isolation`, `sandbox_env`: `reward.isolation` and `reward.sandbox_env` (README: Sandbox)."""
        from grpo_dist.sandbox import Limits as SandboxLimits

        self.config = environment
        self.environment = environment_class(environment.name)
        self.specs = tool_specs(environment)
        self.renderer = Renderer(tokenizer, [spec.chat_template_entry for spec in self.specs])
        self.parser = resolve_parser(environment.tool_parser)
        limits = SandboxLimits(environment.sandbox_memory_mb, environment.tool_timeout_s, False,
                               environment.sandbox_network, isolation == "require", tuple(sandbox_env))  # fmt: skip
        self.tools = ToolBox(self.specs, limits, environment.tool_workers, environment.tool_timeout_s)
        self.limits = Limits(environment.max_turns, environment.max_total_tokens, max_new_tokens)
        self.agent = resolve_named(environment.agent, {}, "environment.agent") if environment.agent else None
        self.endpoint = None
        if self.agent is not None:
            from grpo_dist.agents.endpoint import Endpoint

            self.endpoint = Endpoint(tokenizer, self.parser, self.limits)

    def new_environment(self) -> Environment:
        return self.environment(**self.config.kwargs)

    def first_tokens(self, row: dict[str, Any]) -> list[int]:
        """[P] the first messages of a fresh environment for `row`, rendered (the driver's view of a prompt)."""
        return self.renderer.first(self.new_environment().reset(row))

    async def trajectory(self, row: dict[str, Any], sample: Sampler, seed: int | None) -> Trajectory:
        if self.agent is not None:
            return await self._agent_trajectory(row, sample, seed)
        return await run_episode(self.new_environment(), row, self.renderer, self.parser, self.tools, sample,
                                 self.limits, seed)  # fmt: skip

    async def _agent_trajectory(self, row: dict[str, Any], sample: Sampler, seed: int | None) -> Trajectory:
        """The user's agent run against a session of the endpoint, bounded by `environment.episode_timeout_s`."""
        import asyncio

        import openai

        base_url = self.endpoint.open(sample, seed)
        bound = self.config.episode_timeout_s
        client = openai.AsyncOpenAI(base_url=base_url, api_key="grpo-dist", max_retries=0, timeout=bound)
        found, cut = None, False
        try:
            found = await asyncio.wait_for(self.agent(client, row), bound)
        except TimeoutError:
            cut = True
        finally:
            session = self.endpoint.close(base_url)
            await client.close()
        rewards = dict(found) if isinstance(found, dict) else ({} if found is None else {"agent": float(found)})
        return session.trajectory(rewards, cut, self.config.agent)

    async def start(self) -> None:
        """Open the chat-completions endpoint, when an agent calls it."""
        if self.endpoint is not None:
            await self.endpoint.start()
