"""Bring your own agent: an OpenAI-compatible chat-completions endpoint on each generator, so agent code written
against the `openai` client produces training trajectories, token in and token out.

With `environment.agent` (the dotted path of `async def agent(client, row) -> reward`), each trajectory runs that
function in the generator with an `openai.AsyncOpenAI` client of its own, whose base URL names the trajectory's
session on the generator's endpoint (`http://127.0.0.1:<port>/sessions/<id>/v1`). The agent calls
`client.chat.completions.create(messages=..., tools=...)` as often as it likes, runs its tools itself, and returns
a reward (a number, a dict of named parts, or None: the reward functions judge the last reply).

The endpoint does not re-tokenize the conversation it is sent. Its first call renders the messages with the chat
template (and the request's `tools`); each later call must send the previous call's messages, the reply it got,
and new messages (tool results, a user turn): the engine then continues from the exact tokens so far (the prompt,
each reply as sampled, the new messages rendered as an observation, `grpo_dist.agents.render`). A call whose
conversation does not grow that way (history rewritten) is answered, but it and all later calls stay out of the
trajectory, counted in `agent/diverged`. Sampling is the run's (`rollout.temperature`, `top_p`), since the
learner scores tokens at that temperature; a request's `max_tokens` is honoured up to `rollout.max_new_tokens`, and
the whole conversation stays within `environment.max_total_tokens`. Replies carry the parsed tool calls
(`environment.tool_parser`) as OpenAI `tool_calls`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

from grpo_dist.agents.episode import Limits, Sampled, Sampler, Trajectory
from grpo_dist.agents.render import Renderer
from grpo_dist.types import Episode


@dataclass
class Session:
    """One trajectory's calls, as the endpoint assembles them."""

    sample: Sampler
    seed: int | None
    renderer: Renderer | None = None  # from the first call (its tools)
    history: list[dict[str, Any]] = field(default_factory=list)  # the messages so far, the last reply included
    prompt: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls: int = 0  # calls answered, diverged ones included
    text: str = ""  # the last recorded reply
    finish_reason: str = "stop"
    tool_calls: int = 0
    replies: int = 0  # replies recorded in the trajectory
    diverged: bool = False
    ended_on_eos: bool = True  # the last recorded reply ended with the end-of-sequence token
    closed: bool = False  # its trajectory was taken: a call finishing later is not recorded
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one call at a time extends the trajectory

    def trajectory(self, rewards: dict[str, float], cut: bool, agent: str) -> Trajectory:
        """The recorded calls as one trajectory (copies: the session is closed); `cut`: the agent ran past its
        bound."""
        self.closed = True
        if not self.mask:
            raise RuntimeError(f"environment.agent {agent} got no reply from the model in its trajectory (no call, "
                               "or none with room under environment.max_total_tokens): nothing to train")  # fmt: skip
        truncated = cut or self.finish_reason == "length" or not self.ended_on_eos
        episode = Episode(messages=list(self.history), turns=self.replies, tool_calls=self.tool_calls,
                          truncated=truncated, rewards=rewards, diverged=self.diverged)  # fmt: skip
        finish = "length" if truncated else "stop"
        return Trajectory(list(self.prompt), list(self.tokens), list(self.logprobs), list(self.mask), self.text,
                          finish, list(self.versions), episode)  # fmt: skip


def same_message(sent: dict[str, Any], kept: dict[str, Any]) -> bool:
    """Whether a message sent back is the one the session holds: same role, and for all but the model's replies
    (which clients send back in their own shape) the same content."""
    return sent.get("role") == kept["role"] and (kept["role"] == "assistant" or sent.get("content") == kept["content"])


class Endpoint:
    """The HTTP endpoint of one generator: sessions opened and closed by its trajectories."""

    def __init__(self, tokenizer: Any, parser: Any, limits: Limits) -> None:
        self.tokenizer, self.parser, self.limits = tokenizer, parser, limits
        self.sessions: dict[str, Session] = {}
        self.ids = itertools.count()
        self.port: int | None = None
        self.runner = None

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/sessions/{session}/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def open(self, sample: Sampler, seed: int | None) -> str:
        """A new session; returns the base URL its `openai` client uses."""
        name = str(next(self.ids))
        self.sessions[name] = Session(sample, seed)
        return f"http://127.0.0.1:{self.port}/sessions/{name}/v1"

    def close(self, base_url: str) -> Session:
        return self.sessions.pop(base_url.rsplit("/", 2)[-2])

    async def _chat(self, request):
        from aiohttp import web

        session = self.sessions.get(request.match_info["session"])
        if session is None:
            return web.json_response({"error": {"message": "no such session (its trajectory ended)"}}, status=404)
        body = await request.json()
        messages = [dict(message) for message in body.get("messages") or []]
        if not messages:
            return web.json_response({"error": {"message": "messages: at least one message"}}, status=400)
        async with session.lock:  # calls of one session one after the other, each extending the last
            prefix, observed = self._prefix(session, messages, body.get("tools"))
            asked = body.get("max_completion_tokens") or body.get("max_tokens") or self.limits.max_new_tokens
            room = self.limits.max_total_tokens - len(prefix)
            sampled = Sampled([], [], "length", [])
            if room > 0:
                seed = None if session.seed is None else session.seed + session.calls * 1_000_003
                sampled = await session.sample(prefix, min(asked, self.limits.max_new_tokens, room), seed)
            session.calls += 1
            text = self.tokenizer.decode(sampled.token_ids, skip_special_tokens=True)
            calls = [call for call in self.parser(text) if call.error is None]
            reply = {"role": "assistant", "content": text}
            if observed is not None and sampled.token_ids and not session.closed:
                self._record(session, messages, reply, sampled, observed, len(calls))
        return web.json_response(self._response(body, reply, calls, sampled, len(prefix)))

    def _prefix(self, session: Session, messages: list[dict], tools: list | None) -> tuple[list[int], list[int] | None]:
        """The tokens the engine continues from, and the observation tokens the call adds to the session's
        trajectory (None: it does not extend the trajectory)."""
        if not session.history:  # no reply recorded yet: this call opens the trajectory
            session.renderer = Renderer(self.tokenizer, tools or [])
            session.prompt = session.renderer.first(messages)
            return session.prompt, []
        kept = session.history
        grows = len(messages) > len(kept) and all(same_message(s, k) for s, k in zip(messages, kept, strict=False))
        if session.diverged or not grows or not session.ended_on_eos:
            session.diverged = True
            return Renderer(self.tokenizer, tools or []).first(messages), None
        observed = session.renderer.observation(messages[len(kept) :])
        return session.prompt + session.tokens + observed, observed

    def _record(self, session: Session, messages: list[dict], reply: dict, sampled: Sampled, observed: list[int],
                calls: int) -> None:  # fmt: skip
        """The observation the call added and its reply, into the trajectory."""
        session.history = [*messages, reply]
        session.tokens += observed
        session.logprobs += [0.0] * len(observed)
        session.mask += [0] * len(observed)
        session.tokens += sampled.token_ids
        session.logprobs += sampled.logprobs
        session.mask += [1] * len(sampled.token_ids)
        session.versions += sampled.versions
        session.text, session.finish_reason = reply["content"], sampled.finish_reason
        session.ended_on_eos = sampled.token_ids[-1] == self.tokenizer.eos_token_id
        session.tool_calls += calls
        session.replies += 1

    def _response(self, body: dict, reply: dict, calls: list, sampled: Sampled, prompt_tokens: int) -> dict:
        tool_calls = [
            {"id": f"call_{number}", "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
            for number, call in enumerate(calls)
        ]  # fmt: skip
        finish = "tool_calls" if calls else ("length" if sampled.finish_reason == "length" else "stop")
        completion = len(sampled.token_ids)
        return {
            "id": f"chatcmpl-{time.monotonic_ns()}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", ""),
            "choices": [{"index": 0, "message": {**reply, "tool_calls": tool_calls or None}, "finish_reason": finish,
                         "logprobs": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion},
        }  # fmt: skip
