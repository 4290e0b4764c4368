"""Agentic rollouts: multi-turn episodes in which the model calls tools, token in and token out.

- `protocol`: what an environment is (`Environment.reset` and `step`) and the messages of a turn (`Turn`,
  `ToolCall`, `Observation`).
- `tools`: tools as plain Python functions with a JSON schema, the built-ins (`calculator`), and the `ToolBox` that
  runs calls in sandbox processes, each under `environment.tool_timeout_s`.
- `parsers`: reading the tool calls out of a model turn (`hermes`, or a dotted path); a malformed call becomes an
  error the model reads.
- `render`: the chat template's tokens for the first messages and for each observation, never re-tokenizing what
  the model generated.
- `episode`: one trajectory, run on a generator's engine: sample a turn from the exact token prefix, parse and run
  its tool calls, step the environment, append the observation's tokens; the loss mask covers only sampled tokens.

May import: `rewards`, `sandbox`, `config`, `types` and below (never `cluster` or `run`).
"""

from grpo_dist.agents.protocol import Environment, Observation, ToolCall, Turn, tool_message

__all__ = ["Environment", "Observation", "ToolCall", "Turn", "tool_message"]
