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

Only the trajectory's own agent can write into it: each endpoint has an API key of its own (`Endpoint.api_key`,
random) that its agents' clients send as `Authorization: Bearer <key>` (`openai.AsyncOpenAI(api_key=...)`), and each
session's id is random (`secrets.token_urlsafe`), so another process on the machine (model-written code run by a
tool, another user) can neither guess a session nor call one: a missing or wrong key is answered 401. A malformed
request (not JSON, no `messages`, a `max_tokens` that is not a positive integer) is answered 400 with a JSON error.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from grpo_dist.agents.protocol import Limits, Sampled, Sampler, Trajectory, assign_call_ids, assistant_message
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
    call_ids: set[str] = field(default_factory=set)  # the tool-call ids given so far: each new one unique
    ended_on_eos: bool = True  # the last recorded reply ended with the end-of-sequence token
    closed: bool = False  # its trajectory was taken: a call finishing later is not recorded
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one call at a time extends the trajectory

    def trajectory(self, rewards: dict[str, float], cut: bool, agent: str) -> Trajectory:
        """The recorded calls as one trajectory (copies: the session is closed); `cut`: the agent ran past its
        bound."""
        self.closed = True
        if not self.mask:
            raise RuntimeError(
                f"environment.agent {agent} got no reply from the model in its trajectory (no call, "
                "or none with room under environment.max_total_tokens): nothing to train"
            )
        truncated = cut or self.finish_reason == "length" or not self.ended_on_eos
        episode = Episode(
            messages=list(self.history),
            turns=self.replies,
            tool_calls=self.tool_calls,
            truncated=truncated,
            rewards=rewards,
            diverged=self.diverged,
        )
        finish = "length" if truncated else "stop"
        return Trajectory(
            list(self.prompt),
            list(self.tokens),
            list(self.logprobs),
            list(self.mask),
            self.text,
            finish,
            list(self.versions),
            episode,
        )


def same_message(sent: dict[str, Any], kept: dict[str, Any]) -> bool:
    """Whether a message sent back is the one the session holds: same role, and for all but the model's replies
    (which clients send back in their own shape) the same content."""
    return sent.get("role") == kept["role"] and (kept["role"] == "assistant" or sent.get("content") == kept["content"])


class BadRequest(ValueError):
    """A chat-completions request the endpoint cannot read; answered 400 with this message."""


def read_request(body: Any) -> tuple[list[dict[str, Any]], list | None, int | None]:
    """The messages, tools and asked `max_completion_tokens` (or `max_tokens`; None: not asked) of a request's
    parsed JSON body; `BadRequest` naming the field when one is malformed."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: at least one message (a list of objects)")
    if not all(isinstance(message, dict) and isinstance(message.get("role"), str) for message in messages):
        raise BadRequest("messages: each message must be an object with a string `role`")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools: a list of tool definitions")
    return [dict(message) for message in messages], tools, asked_tokens(body)


def asked_tokens(body: dict[str, Any]) -> int | None:
    """The request's `max_completion_tokens`, else its `max_tokens` (None: neither); `BadRequest` unless a positive
    integer."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadRequest(f"{name}: a positive integer (got {json.dumps(value)[:40]})")
        return value
    return None


def error_answer(status: int, message: str, kind: str):
    """An OpenAI-shaped JSON error answer."""
    from aiohttp import web

    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return web.json_response({"error": {"message": message, "type": kind}}, status=status, headers=headers)


class Endpoint:
    """The HTTP endpoint of one generator: sessions opened and closed by its trajectories, each called with the
    endpoint's `api_key`."""

    def __init__(self, tokenizer: Any, parser: Any, limits: Limits) -> None:
        self.tokenizer, self.parser, self.limits = tokenizer, parser, limits
        self.sessions: dict[str, Session] = {}
        self.api_key = secrets.token_urlsafe(32)  # what its agents' `openai` clients send as the Bearer token
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
        """A new session; returns the base URL its `openai` client uses (with `api_key`). Its id is random, so no
        other process can guess it."""
        name = secrets.token_urlsafe(16)
        self.sessions[name] = Session(sample, seed)
        return f"http://127.0.0.1:{self.port}/sessions/{name}/v1"

    def close(self, base_url: str) -> Session:
        return self.sessions.pop(base_url.rsplit("/", 2)[-2])

    def authorized(self, request) -> bool:
        """Whether the request carries this endpoint's key as `Authorization: Bearer <key>` (compared in constant
        time)."""
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def _chat(self, request):
        from aiohttp import web

        if not self.authorized(request):
            why = "missing or wrong API key: send the endpoint's key as `Authorization: Bearer <key>` (`api_key=`)"
            return error_answer(401, why, "authentication_error")
        session = self.sessions.get(request.match_info["session"])
        if session is None:
            return error_answer(404, "no such session (its trajectory ended)", "not_found_error")
        try:
            body = json.loads(await request.text())
            messages, tools, asked = read_request(body)
        except ValueError as err:  # `BadRequest`, and the errors of decoding the text and the JSON
            why = str(err) if isinstance(err, BadRequest) else f"the body is not JSON ({err})"
            return error_answer(400, why, "invalid_request_error")
        async with session.lock:  # calls of one session one after the other, each extending the last
            # tokenizing what the agent sent (up to 64 MiB: seconds) off the loop
            prefix, observed = await asyncio.to_thread(self._prefix, session, messages, tools)
            asked = asked or self.limits.max_new_tokens
            room = self.limits.max_total_tokens - len(prefix)
            sampled = Sampled([], [], "length", [])
            if room > 0:
                seed = None if session.seed is None else session.seed + session.calls * 1_000_003
                sampled = await session.sample(prefix, min(asked, self.limits.max_new_tokens, room), seed)
            session.calls += 1
            text = self.tokenizer.decode(sampled.token_ids, skip_special_tokens=True)
            calls = [call for call in self.parser(text) if call.error is None]
            assign_call_ids(calls, session.call_ids)
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

    def _record(
        self, session: Session, messages: list[dict], reply: dict, sampled: Sampled, observed: list[int], calls: int
    ) -> None:
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
        tool_calls = assistant_message(reply["content"], calls).get("tool_calls")
        finish = "tool_calls" if calls else ("length" if sampled.finish_reason == "length" else "stop")
        completion = len(sampled.token_ids)
        return {
            "id": f"chatcmpl-{time.monotonic_ns()}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", ""),
            "choices": [
                {"index": 0, "message": {**reply, "tool_calls": tool_calls}, "finish_reason": finish, "logprobs": None}
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
            },
        }
