"""Agentic rollouts: the protocol's pieces (tool-call parsing, tool schemas, the chat template's tokens, tools in
their sandboxes under a bound), then multi-turn trajectories on real vLLM generators: the trained tokens are the
engine's, the loss mask is exactly the sampled tokens, a slow tool holds back only its own trajectory, a generator
lost mid-trajectory loses no trajectory, and the bundled calculator task runs through `grpo-dist sft` and
`grpo-dist train`."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from agent_fixtures import NAP_DIR, NAP_MARK, NAP_S
from conftest import small_config, train_here, warm_shared_env

from grpo_dist.agents.episode import TURN_SEED_STRIDE
from grpo_dist.agents.parsers import hermes
from grpo_dist.agents.protocol import ToolCall
from grpo_dist.agents.render import Renderer, TemplateError
from grpo_dist.agents.tools import ToolBox, argument_error, calculator, tool_spec
from grpo_dist.algo.batch import collate
from grpo_dist.config import ConfigError, validate_config
from grpo_dist.models.tiny import CHAT_TEMPLATE, build_tiny_tokenizer
from grpo_dist.sandbox import Limits


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(CHAT_TEMPLATE)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param('<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>',
                     [("calculator", {"expression": "2*3"}, None)], id="one"),
        pytest.param('a<tool_call>{"name":"f","arguments":{}}</tool_call>b<tool_call>{"name":"g"}</tool_call>',
                     [("f", {}, None), ("g", {}, None)], id="two_in_order"),
        pytest.param('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
                     [("f", {"x": 1}, None)], id="arguments_as_a_json_string"),
        pytest.param("<tool_call>{name: f}</tool_call>", [("", {}, "not JSON")], id="not_json"),
        pytest.param('<tool_call>["f"]</tool_call>', [("", {}, "must be a JSON object")], id="not_an_object"),
        pytest.param('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
                     [("f", {}, "arguments must be a JSON object")], id="arguments_not_an_object"),
        pytest.param('<tool_call>{"name": "f"}', [("", {}, "without its </tool_call>")], id="unclosed"),
        pytest.param("the answer is 6", [], id="no_call"),
    ],
)  # fmt: skip
def test_hermes_reads_each_call_and_turns_a_malformed_one_into_an_error(text, expected):
    calls = hermes(text)
    assert [(call.name, call.arguments) for call in calls] == [(name, args) for name, args, _ in expected]
    for call, (_, _, error) in zip(calls, expected, strict=True):
        assert (call.error is None) if error is None else (error in call.error), call.error


def test_a_tools_schema_is_read_from_the_function_and_its_arguments_checked():
    spec = tool_spec("calculator")
    assert spec.schema == {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    }
    assert argument_error(spec, {"expression": "1+1"}) is None
    assert "missing argument 'expression'" in argument_error(spec, {})
    assert "unexpected argument 'x'" in argument_error(spec, {"expression": "1", "x": 2})
    assert "must be a JSON string, got 12" in argument_error(spec, {"expression": 12})
    sleep = tool_spec("agent_fixtures.sleep")
    assert sleep.schema["parameters"]["properties"] == {"seconds": {"type": "number"}}
    assert argument_error(sleep, {"seconds": 1}) is None  # an integer is a JSON number
    with pytest.raises(ValueError, match="not a built-in"):
        tool_spec("calculater")


@pytest.mark.parametrize(
    ("expression", "result"),
    [("37*48", "1776"), ("(1+2)*-3", "-9"), ("7/2", "3.5"), ("8/4", "2"), ("2**10 % 1000", "24")],
)
def test_the_calculator_computes_arithmetic(expression, result):
    assert calculator(expression) == result


@pytest.mark.parametrize("expression", ["__import__('os')", "2**1000", "x+1", "9**9**9"])
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expression):
    with pytest.raises((ValueError, SyntaxError)):
        calculator(expression)


def test_a_rendered_trajectory_is_the_chat_templates_rendering_of_its_conversation(tokenizer):
    """first messages + turn + observation + turn, each rendered on its own, decode to the template's rendering of
    the whole conversation (up to the last turn's end), whatever the turns hold."""
    renderer = Renderer(tokenizer, [tool_spec("calculator").chat_template_entry])
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "37*48="}]
    turns = ['<tool_call>{"name":"calculator","arguments":{"expression":"37*48"}}</tool_call>', "1776"]
    observation = [{"role": "tool", "content": "1776"}, {"role": "tool", "content": "error: none"}]
    tokens = renderer.first(first) + renderer.turn(turns[0]) + renderer.observation(observation)
    tokens += renderer.turn(turns[1])
    conversation = [*first, {"role": "assistant", "content": turns[0]}, *observation,
                    {"role": "assistant", "content": turns[1]}]  # fmt: skip
    whole = tokenizer.apply_chat_template(conversation, tools=renderer.tools, tokenize=False)
    assert whole.startswith(tokenizer.decode(tokens)) and whole[len(tokenizer.decode(tokens)) :] == "\n"
    assert renderer.observation(observation)[0] == tokenizer.convert_tokens_to_ids("Ċ")  # the template's newline


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    tokenizer = build_tiny_tokenizer("{{ messages[-1]['content'] }}<eos>{% if add_generation_prompt %}>{% endif %}")
    renderer = Renderer(tokenizer, [])
    with pytest.raises(TemplateError, match="rewrites earlier turns"):
        renderer.observation([{"role": "tool", "content": "1"}])
    with pytest.raises(TemplateError, match="needs a chat template"):
        Renderer(build_tiny_tokenizer(), [])


def toolbox(paths: list[str], workers: int, timeout_s: float) -> ToolBox:
    return ToolBox([tool_spec(path) for path in paths], Limits(1024, timeout_s, False, False), workers, timeout_s)


def test_tools_run_in_sandboxes_a_slow_call_holds_back_only_itself_and_one_past_its_bound_is_an_error():
    box = toolbox(["calculator", "agent_fixtures.sleep"], workers=2, timeout_s=3.0)
    finished: list[str] = []

    async def run(name: str, calls: list[ToolCall]) -> list[ToolCall]:
        await box.run(calls)
        finished.append(name)
        return calls

    async def both():
        slow = run("slow", [ToolCall("sleep", {"seconds": 30})])
        fast = run("fast", [ToolCall("calculator", {"expression": "6*7"}), ToolCall("calc", {}),
                            ToolCall("calculator", {"expression": 6}), ToolCall("", error="not JSON")])  # fmt: skip
        return await asyncio.gather(slow, fast)

    try:
        (slept,), (product, unknown, mistyped, malformed) = asyncio.run(both())
        assert finished == ["fast", "slow"]  # the fast trajectory's calls did not wait for the slow one's
        assert product.result == "42" and product.error is None
        assert "no tool 'calc'; the tools are calculator, sleep" in unknown.error
        assert "must be a JSON string" in mistyped.error and malformed.error == "not JSON"
        assert slept.result is None and "timed out after 3s" in slept.error and "tool sandbox was killed" in slept.error
        (again,) = asyncio.run(run("after", [ToolCall("calculator", {"expression": "1+1"})]))
        assert again.result == "2"  # a sandbox is back for the next call
    finally:
        box.close()


def test_a_tools_flood_reaches_the_model_cut_and_one_past_the_answer_limit_is_an_error():
    """A result is read in linear time and cut to what the model reads; one past the sandbox's answer limit is an
    error, and the sandbox is replaced."""
    from grpo_dist.agents.tools import RESULT_LIMIT
    from grpo_dist.sandbox import ANSWER_LIMIT

    box = toolbox(["agent_fixtures.flood", "agent_fixtures.echo"], workers=1, timeout_s=60.0)
    calls = [ToolCall("flood", {"megabytes": 16}), ToolCall("flood", {"megabytes": (ANSWER_LIMIT >> 20) + 8}),
             ToolCall("echo", {"text": "after"})]  # fmt: skip
    try:
        asyncio.run(box.run(calls))
    finally:
        box.close()
    flooded, past, after = calls
    assert flooded.error is None and flooded.result.startswith("x" * RESULT_LIMIT + "\n[result cut: 16777216")
    assert len(flooded.result) < RESULT_LIMIT + 100
    assert past.result is None and past.error.startswith(f"its answer ran past {ANSWER_LIMIT >> 20} MiB")
    assert after.result == "echo after"


def test_an_environments_step_runs_off_the_event_loop(tokenizer):
    """The step and the tokenizing of its observation (long ones take seconds) run on a thread of their own, so
    the generator's event loop goes on serving the engine meanwhile."""
    import threading

    from agent_fixtures import ThreadNotingEnvironment

    from grpo_dist.agents.episode import AgentLoop
    from grpo_dist.config import EnvironmentConfig

    config = EnvironmentConfig(name="agent_fixtures.ThreadNotingEnvironment", tool_parser="agent_fixtures.always_echo")
    ThreadNotingEnvironment.stepped_on.clear()
    _, worked = failing_and_working(AgentLoop(config, tokenizer, max_new_tokens=8), scripted(tokenizer, ["hi"]))
    assert worked.episode.turns == 2 and len(ThreadNotingEnvironment.stepped_on) >= 2
    assert threading.main_thread().name not in ThreadNotingEnvironment.stepped_on  # asyncio.run's loop is main's


def test_an_episode_opens_with_the_environments_first_messages_and_tools(tokenizer):
    """The first tokens are the chat template's rendering of what the environment's `reset` returns for the row,
    with its tools (the class's own unless `environment.tools` names others)."""
    from grpo_dist.agents.episode import AgentLoop
    from grpo_dist.config import EnvironmentConfig

    row = {"messages": [{"role": "user", "content": "2*3="}], "answer": "6"}
    config = EnvironmentConfig(name="agent_fixtures.CountingEnvironment", kwargs={"system": "count"})
    loop = AgentLoop(config, tokenizer, max_new_tokens=8)
    expected = "<|tools|>echo<eos>\n<|system|>count<eos>\n<|user|>2*3=<eos>\n<|assistant|>"
    assert tokenizer.decode(loop.first_tokens(row)) == expected
    loop = AgentLoop(config.model_copy(update={"tools": ["calculator"]}), tokenizer, max_new_tokens=8)
    assert tokenizer.decode(loop.first_tokens(row)).startswith("<|tools|>calculator<eos>")
    with pytest.raises(ValueError, match="not `tools` nor the dotted path of a grpo_dist.agents.Environment"):
        AgentLoop(EnvironmentConfig(name="agent_fixtures.echo"), tokenizer, max_new_tokens=8)


def scripted(tokenizer, replies: list[str]):
    """A stand-in for the engine: turn i of a trajectory is `replies[i]` (the last one again after), then the
    end-of-sequence token; each token's logprob -0.5, sampled by weight version 0."""
    from grpo_dist.agents.protocol import Sampled

    turns: dict[int | None, int] = {}  # seed (one per trajectory) -> turns sampled

    async def sample(prefix: list[int], max_tokens: int, seed: int | None) -> Sampled:
        trajectory = None if seed is None else seed % TURN_SEED_STRIDE
        number = turns.get(trajectory, 0)
        turns[trajectory] = number + 1
        text = replies[min(number, len(replies) - 1)]
        ids = [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id][:max_tokens]
        return Sampled(ids, [-0.5] * len(ids), "stop" if ids[-1] == tokenizer.eos_token_id else "length", [0])

    return sample


ROW = {"messages": [{"role": "user", "content": "2*3="}]}
FAILING_ROW = {**ROW, "fail": True}
DRIVER_PROMPT = [7, 8, 9]
"""The driver's rendering of a row: what a failed trajectory keeps as its prompt."""


def failing_and_working(loop, sample) -> tuple:
    """A trajectory of `FAILING_ROW` and one of `ROW`, run at once on `loop` (its endpoint up, for an agent)."""

    async def both():
        await loop.start()
        try:
            return await asyncio.gather(loop.trajectory(FAILING_ROW, sample, 0, DRIVER_PROMPT),
                                        loop.trajectory(ROW, sample, 1, DRIVER_PROMPT))  # fmt: skip
        finally:
            if loop.endpoint is not None:
                await loop.endpoint.runner.cleanup()

    try:
        return tuple(asyncio.run(both()))
    finally:
        loop.tools.close()


def assert_failed_alone(failed, worked, reason: str, replies: int) -> None:
    """`failed` holds no tokens, only the driver's prompt, and says why (the first line of the error); `worked`
    went on as if nothing happened: `replies` turns of "hi" and the end-of-sequence token, 3 sampled tokens each."""
    assert (failed.prompt_token_ids, failed.token_ids, failed.mask, failed.finish_reason) == (DRIVER_PROMPT, [], [],
                                                                                              "failed")  # fmt: skip
    assert failed.episode.failure == reason
    assert (worked.finish_reason, worked.episode.failure, sum(worked.mask)) == ("stop", None, 3 * replies)
    assert worked.prompt_token_ids != DRIVER_PROMPT  # its own rendering of its first messages


@pytest.mark.parametrize(
    ("fail_in", "reason"),
    [
        pytest.param("reset", "RaisingEnvironment.reset raised KeyError: 'question'", id="reset"),
        pytest.param("messages", "RaisingEnvironment.reset raised TypeError: returned the message {'content': 'a "
                     "message without a role'}, not a dict with a str 'role'", id="first_messages_without_a_role"),
        pytest.param("step", "RaisingEnvironment.step raised ValueError: turn 1 is not what I expected", id="step"),
        pytest.param("reward", "RaisingEnvironment.step raised ValueError: could not convert string to float: "
                     "'plenty'", id="reward_not_a_number"),
        pytest.param("exit", "RaisingEnvironment.step raised SystemExit: 3", id="sys_exit_in_step"),
    ],
)  # fmt: skip
def test_an_environment_that_raises_fails_only_its_own_trajectory(tokenizer, fail_in, reason):
    from grpo_dist.agents.episode import AgentLoop
    from grpo_dist.config import EnvironmentConfig

    config = EnvironmentConfig(name="agent_fixtures.RaisingEnvironment", kwargs={"fail_in": fail_in})
    failed, worked = failing_and_working(AgentLoop(config, tokenizer, max_new_tokens=8), scripted(tokenizer, ["hi"]))
    assert_failed_alone(failed, worked, reason, replies=2)
    if fail_in == "step":  # its conversation up to the failure is kept, for the completion table
        assert failed.episode.messages == [*ROW["messages"], {"role": "assistant", "content": "hi"}]


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        pytest.param({"name": "agent_fixtures.RaisingEnvironment", "kwargs": {"fail_in": "init"}},
                     "RaisingEnvironment.__init__ raised RuntimeError: cannot connect to the task server",
                     id="constructor"),
        pytest.param({"name": "agent_fixtures.CountingEnvironment", "tool_parser": "agent_fixtures.raising_parser"},
                     "tool parser raising_parser raised RuntimeError: the parser's own bug", id="tool_parser"),
    ],
)  # fmt: skip
def test_user_code_failing_every_trajectory_fails_each_with_the_first_line_of_its_error(tokenizer, config, reason):
    from grpo_dist.agents.episode import AgentLoop
    from grpo_dist.config import EnvironmentConfig

    loop = AgentLoop(EnvironmentConfig(**config), tokenizer, max_new_tokens=8)
    for trajectory in failing_and_working(loop, scripted(tokenizer, ["hi"])):
        assert (trajectory.token_ids, trajectory.finish_reason, trajectory.episode.failure) == ([], "failed", reason)


@pytest.mark.parametrize(
    ("agent", "reason"),
    [
        pytest.param("raising_agent", "raised KeyError: 'the reply has no answer'", id="raises"),
        pytest.param("exiting_agent", "raised SystemExit: 2", id="sys_exit"),
        pytest.param("silent_agent", "raised RuntimeError: it got no reply from the model to train on (no call, or "
                     "none with room under environment.max_total_tokens)", id="never_asks_the_model"),
        pytest.param("wordy_agent", "(its return value) raised ValueError: could not convert string to float: "
                     "'correct'", id="returns_no_number"),
    ],
)  # fmt: skip
def test_an_agent_that_raises_fails_only_its_own_trajectory(tokenizer, agent, reason):
    """Through the real endpoint and `openai` client; the engine is scripted."""
    from grpo_dist.agents.episode import AgentLoop
    from grpo_dist.config import EnvironmentConfig

    config = EnvironmentConfig(agent=f"agent_fixtures.{agent}", tool_parser="none")
    failed, worked = failing_and_working(AgentLoop(config, tokenizer, max_new_tokens=8), scripted(tokenizer, ["hi"]))
    assert_failed_alone(failed, worked, f"environment.agent agent_fixtures.{agent} {reason}", replies=1)
    assert worked.episode.rewards == {"agent": 1.0}


def test_each_tool_result_names_its_call_by_an_id_unique_in_the_trajectory(tokenizer):
    """Two calls a turn (`echo_twice`): ids are given where the model gave none (`call_<n>`) and where it gave one
    the trajectory already used (`mine`, from the second turn on); each `tool` message carries the id of the call it
    answers, listed in the assistant message before it, and that call's own result."""
    from grpo_dist.agents.episode import AgentLoop
    from grpo_dist.config import EnvironmentConfig

    config = EnvironmentConfig(tools=["agent_fixtures.echo"], tool_parser="agent_fixtures.echo_twice", max_turns=3)
    _, trajectory = failing_and_working(AgentLoop(config, tokenizer, max_new_tokens=8),
                                        scripted(tokenizer, ["one", "two", "six"]))  # fmt: skip
    messages = trajectory.episode.messages[1:]
    listed = [[call["id"] for call in m["tool_calls"]] for m in messages if m["role"] == "assistant"]
    assert listed == [["call_0", "mine"], ["call_1", "call_2"], ["call_3", "call_4"]]  # the third turn's not run
    answered = {call["id"]: json.loads(call["function"]["arguments"])["text"]
                for m in messages if m["role"] == "assistant" for call in m["tool_calls"]}  # fmt: skip
    tools = [(m["tool_call_id"], m["content"]) for m in messages if m["role"] == "tool"]
    assert tools == [("call_0", "echo one-1"), ("mine", "echo one-2"), ("call_1", "echo two-1"),
                     ("call_2", "echo two-2")]  # fmt: skip
    assert all(content == f"echo {answered[call_id]}" for call_id, content in tools)


def test_a_parsers_call_ids_are_kept_and_the_missing_ones_assigned():
    from grpo_dist.agents.protocol import assign_call_ids

    calls = hermes('<tool_call>{"name": "f", "arguments": {}, "id": "x7"}</tool_call><tool_call>{"name": "g"}'
                   '</tool_call><tool_call>{"name": "h", "id": "call_0"}</tool_call>')  # fmt: skip
    assert [call.id for call in calls] == ["x7", None, "call_0"]
    taken = {"call_1"}  # an id of an earlier turn
    assign_call_ids(calls, taken)
    # g: the first free call_<n> is call_0; h's own call_0 is then taken, and call_1 too: call_2.
    assert [call.id for call in calls] == ["x7", "call_0", "call_2"] and taken == {"x7", "call_0", "call_1", "call_2"}


def test_a_failed_trajectory_is_unscored_untrained_counted_and_printed_once(capsys):
    """No reward function is called for it; it is unscored (so out of its group's statistics), its row trains no
    token, `agent/failed` counts it, its reason is printed once per run, and a run of nothing but failures stops
    naming it (`reward.max_unscored_fraction`)."""
    import torch

    from grpo_dist.cluster.reward_pool import RewardFailures, RewardPool
    from grpo_dist.data import PromptRecord
    from grpo_dist.faults import RunFailed
    from grpo_dist.run.metrics import episode_metrics
    from grpo_dist.run.rollouts import score_requests
    from grpo_dist.types import Completion, Episode, Score

    why = "RaisingEnvironment.step raised ValueError: turn 1 is not what I expected"
    failed = Completion(0, [1, 2], [], "", [], "failed", 0, mask=[], episode=Episode(failure=why))
    worked = Completion(0, [1, 2], [5, 6], "6", [-0.5, -0.5], "stop", 0, mask=[1, 1], episode=Episode(turns=1))
    requests = score_requests([PromptRecord("2*3=", [1, 2], {"answer": "6"}, 0)], [failed, worked, failed])
    assert [request.failure for request in requests] == [why, None, why]
    pool = RewardPool.__new__(RewardPool)  # its `score` alone, the workers' part stood in for
    pool.names, pool.failures, asked = ["math_answer"], RewardFailures(["math_answer"], 0.5, 2), []
    pool._score = lambda kept, judge: asked.extend(kept) or [Score(1.0, [1.0]) for _ in kept]
    scores = pool.score(requests)
    assert asked == [requests[1]]
    assert [math.isnan(score.total) for score in scores] == [True, False, True]
    assert math.isnan(scores[0].per_function[0]) and scores[0].failures == {}
    pool.failures.end_step()
    pool.score(requests)
    assert capsys.readouterr().out.count(f"a trajectory failed: {why} (it is unscored") == 1
    with pytest.raises(RunFailed, match=f"a trajectory: {why}"):
        pool.failures.end_step()  # 2 of 3 unscored, over 0.5, 2 steps in a row
    assert episode_metrics([failed, worked, failed])["agent/failed"] == 2.0
    assert collate([failed, worked], torch.zeros(2), pad_token_id=0).completion_mask.sum(1).tolist() == [0.0, 2.0]


def test_an_environment_must_fit_the_engine_and_name_tools_that_exist(tmp_path):
    raw = small_config(tmp_path, environment={"max_total_tokens": 64})
    with pytest.raises(ConfigError, match=r"environment.max_total_tokens \(64\) is above rollout.max_model_len"):
        validate_config(raw)
    raw = small_config(tmp_path, environment={"max_total_tokens": 32}, data={"max_prompt_tokens": 32})
    with pytest.raises(ConfigError, match="leaves no room for a turn"):
        validate_config(raw)


def task_config(tmp_path: Path, **sections) -> dict:
    """The bundled calculator task (`configs/agent.yaml`) made small: a warm-up of 150 steps, 2 training steps."""
    raw = yaml.safe_load((Path(__file__).parent.parent / "configs" / "agent.yaml").read_text())
    raw["run"].update(output_dir=str(tmp_path / "outputs"), steps=2)
    raw["model"]["path"] = str(tmp_path / "agent-sft")
    raw["sft"].update(base=str(tmp_path / "agent-base"), steps=150, answer_field="transcript")  # all with the tool
    raw["data"].update(task={"name": "multiply", "num_train": 200, "num_eval": 8}, prompts_per_step=4)
    raw["rollout"].update(group_size=4, cpu_kv_cache_gib=0.05)
    raw["learner"].update(micro_batch_size=16)
    raw["eval"] = {"every": 1, "sets": [{"name": "held_out"}]}
    raw["wandb"] = {"enabled": False}
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return raw


@pytest.fixture(scope="module")
def warmed_up(tmp_path_factory) -> Path:
    """`grpo-dist sft` of the calculator task, short: its model writes tool calls and short answers, each turn
    ended by the end-of-sequence token (a random-init model rarely stops)."""
    directory = tmp_path_factory.mktemp("agent")
    config = directory / "agent.yaml"
    config.write_text(yaml.safe_dump(task_config(directory)))
    done = subprocess.run([sys.executable, "-m", "grpo_dist", "sft", str(config)], capture_output=True, text=True,
                          env=warm_shared_env(dict(os.environ)), timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return directory


def start_pool(directory: Path, environment: dict, tmp_path: Path):
    """One generator of the warmed-up model, its completions trajectories in `environment` (over the task's
    defaults); with the pool's config, placement, fault log, training prompts and tokenizer."""
    from grpo_dist.cluster.generator_pool import GeneratorPool
    from grpo_dist.cluster.placement import place
    from grpo_dist.faults import FaultLog
    from grpo_dist.run.inputs import load_tokenizer, prepare_data, read_prompts

    environment = {**task_config(tmp_path)["environment"], "max_total_tokens": 176, **environment}
    raw = task_config(tmp_path, environment=environment)  # room in the engine to read back a whole trajectory
    raw["model"] = {"path": str(directory / "agent-sft")}
    raw["data"]["task"] = {"name": "multiply", "num_train": 16, "num_eval": 4}
    config = validate_config(raw)
    tokenizer = load_tokenizer(config.model.path)
    prompts = read_prompts(config, prepare_data(config)[0], tokenizer)[0]
    placement = place(config)
    faults = FaultLog()
    pool = GeneratorPool(config, config.model.path, placement, faults)
    pool.pool.wait_ready()
    return config, pool, placement, faults, prompts, tokenizer


def run_to_end(generation) -> list[list]:
    """Every group of a generation, in the order they finished."""
    groups = []
    while not generation.finished:
        advanced = generation.advance()
        groups += advanced.groups
    return groups


def assert_token_exact(actor, completion, renderer) -> None:
    """The engine's own log-probabilities of the whole trajectory, read back, equal the sampling log-probabilities
    at every sampled token (each turn was sampled from exactly the tokens before it); the tokens the mask leaves out
    are exactly the observations (the messages between the model's turns) as the chat template renders them, with
    log-probability 0."""
    import ray

    sequence = completion.prompt_token_ids + completion.token_ids
    engine = ray.get(actor.sequence_logprobs.remote(sequence), timeout=120)  # [P+T-1]
    start = len(completion.prompt_token_ids)
    sampled = [i for i, bit in enumerate(completion.mask) if bit]
    assert len(sampled) == completion.sampled_tokens > 0
    for i in sampled:
        assert engine[start + i - 1] == pytest.approx(completion.logprobs[i], abs=2e-4), i
    replies = [i for i, m in enumerate(completion.episode.messages) if m["role"] == "assistant"]
    between = [completion.episode.messages[a + 1 : b] for a, b in zip(replies, replies[1:], strict=False)]
    expected = [token for run in between for token in renderer.observation(run)]
    assert [t for t, bit in zip(completion.token_ids, completion.mask, strict=True) if not bit] == expected
    assert all(completion.logprobs[i] == 0.0 for i, bit in enumerate(completion.mask) if not bit)


def generator_pid(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def napped(messages: list[dict]) -> bool:
    """Whether a conversation holds the answer of the `nap` call that slept."""
    return any(m["role"] == "tool" and m["content"] == "slept" for m in messages)


@pytest.mark.slow
def test_trajectories_are_the_engines_tokens_a_slow_tool_holds_back_only_its_own_and_a_lost_generator_loses_none(
    ray_cluster, warmed_up, tmp_path
):
    """Four prompts' groups of two trajectories on one generator, in an environment that gives 0.25 per turn and ends
    episodes at turn 3; every turn calls `nap`, and the first call on the machine sleeps 6 s.
    - Every other group comes back first, then the one holding the slow trajectory.
    - Each trajectory is token-exact (`assert_token_exact`), decodes to the chat template's rendering of its
      conversation, and the collated batch trains exactly its sampled tokens.
    - Then the same again, and the generator's process is killed while the slow tool runs: it is replaced, the
      prompts it held are generated again, and every group comes back whole."""
    import torch

    from grpo_dist.agents.render import Renderer

    environment = {"name": "agent_fixtures.CountingEnvironment", "kwargs": {"turns": 3}, "max_turns": 4,
                   "tools": ["agent_fixtures.nap"], "tool_parser": "agent_fixtures.always_nap", "tool_workers": 4,
                   "tool_timeout_s": 60, "sandbox_paths": [NAP_DIR]}  # fmt: skip
    Path(NAP_DIR).mkdir(exist_ok=True)
    Path(NAP_DIR).chmod(0o777)  # the tools write their mark here as `nobody`
    Path(NAP_MARK).unlink(missing_ok=True)
    config, pool, placement, faults, prompts, tokenizer = start_pool(warmed_up, environment, tmp_path)
    try:
        groups = run_to_end(pool.start(prompts[:4], 2, seeds=[1, 2, 3, 4]))
        # The group whose tool slept (by what the tool answered: under load a sandbox's start alone can take
        # seconds) came back last, and its trajectory waited the nap out: the others did not wait for it.
        slept = [[napped(c.episode.messages) for c in g] for g in groups]
        assert [i for i, g in enumerate(slept) if any(g)] == [3], slept
        assert max(c.episode.tool_seconds for c in groups[3]) >= NAP_S
        completions = [c for group in groups for c in group]
        renderer = Renderer(tokenizer, [tool_spec("agent_fixtures.nap").chat_template_entry])
        for completion in completions:
            episode = completion.episode
            assert episode.tool_calls in (episode.turns, episode.turns - 1)  # a turn cut at its token limit: none
            if not episode.truncated:  # ended by the environment, not cut at the token limit
                assert episode.turns == 3 and completion.finish_reason == "stop" and episode.rewards == {"step": 0.75}
            assert_token_exact(pool.actors[0], completion, renderer)
            whole = tokenizer.apply_chat_template(episode.messages, tools=renderer.tools, tokenize=False)
            decoded = tokenizer.decode(completion.prompt_token_ids + completion.token_ids)
            ended = completion.token_ids[-1] == tokenizer.eos_token_id  # else cut: the template closes its turn
            assert whole == decoded + ("\n" if ended else "<eos>\n"), (whole, decoded)
        assert max(c.episode.turns for c in completions) >= 2  # multi-turn: observations between turns
        batch = collate(completions, torch.zeros(len(completions)), tokenizer.pad_token_id)
        for row, completion in enumerate(completions):
            start = len(completion.prompt_token_ids)
            trained = batch.completion_mask[row, start : start + len(completion.token_ids)].tolist()
            assert trained == [float(bit) for bit in completion.mask]
            assert batch.completion_mask[row].sum() == completion.sampled_tokens

        Path(NAP_MARK).unlink()
        generation = pool.start(prompts[:4], 2, seeds=[1, 2, 3, 4])
        lost, groups = pool.actors[0], []
        deadline = time.monotonic() + 120
        while not Path(NAP_MARK).exists() and time.monotonic() < deadline:  # until a trajectory is in its tool call
            groups += generation.advance(poll=True).groups
        assert Path(NAP_MARK).exists()
        os.kill(generator_pid(lost), signal.SIGKILL)
        groups += run_to_end(generation)
        assert sorted(c.prompt_index for g in groups for c in g) == [0, 0, 1, 1, 2, 2, 3, 3]
        assert all(c.episode is not None and c.episode.turns >= 1 for g in groups for c in g)
        assert pool.actors[0] is not lost
        assert faults.counts["generator_restarts"] == 1 and faults.counts["regenerated"] >= 1, faults.counts
    finally:
        Path(NAP_MARK).unlink(missing_ok=True)
        pool.shutdown()
        placement.remove()


@pytest.mark.slow
def test_the_calculator_task_trains_through_sft_and_train_with_whole_conversations_logged(
    ray_cluster, capfd, warmed_up
):
    """The bundled task as `make demo-agent` runs it, made short: after the warm-up (the fixture), three GRPO steps
    over multi-turn episodes with the calculator in its sandbox, here with in-flight weight updates (`max_staleness`
    1) and every tool turn also sleeping 3 s in a second tool, so that updates land while trajectories wait on their
    tools: such trajectories span two weight versions and count the older. Checked: the steps' agent metrics, the
    staleness bound, the conversations in the completion table, and the held-out evaluation (with the tool) before,
    during and after. The run is the command's, in this process, on the session's Ray cluster."""
    raw = task_config(warmed_up, run={"steps": 3}, rollout={"max_staleness": 1, "max_model_len": 256},
                      sync={"mode": "in_flight"})  # fmt: skip
    raw["environment"].update(tools=["calculator", "agent_fixtures.sleep"], tool_workers=16,
                              tool_parser="agent_fixtures.hermes_and_sleep", max_total_tokens=256)  # fmt: skip
    raw["reward"]["functions"].append({"name": "tool_use", "weight": 0.2})
    raw["wandb"]["table_every"] = 1  # every step's groups in completions.jsonl
    config = warmed_up / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    code, out = train_here(capfd, config)
    assert code == 0, out[-3000:]
    run_dir = warmed_up / "outputs" / "agent"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert row["agent/turns"] >= 1 and row["agent/tool_calls"] > 0  # the warmed-up model calls the calculator
        assert 0 <= row["agent/tool_error_fraction"] <= 1 and 0 <= row["agent/truncated_fraction"] <= 1
        assert row["staleness/max"] <= 1 and row["agent/tool_seconds_max"] >= 3.0
    assert any(row["staleness/spanning"] > 0 for row in rows[1:]), [row["staleness/spanning"] for row in rows]
    table = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert any("\ntool: " in row["completion"] and row["turns"] >= 2 for row in table)
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [row["step"] for row in evals] == [0, 1, 2, 3] and all("eval/held_out/accuracy" in row for row in evals)
    assert (run_dir / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_student_distilled_from_itself_over_multi_turn_episodes_has_no_kl_on_its_own_tokens(
    ray_cluster, capfd, warmed_up, tmp_path
):
    """`algorithm.distill` over multi-turn episodes, its teacher the student's own starting model: a teacher engine
    scores each whole trajectory (the tool's answers included) as one prompt, and at every token the model sampled
    its log-prob equals the student's sampling log-prob, so the reverse KL is 0 to float noise. Had the tool's
    tokens counted (the student gives them log-prob 0, the teacher several nats less) or the teacher's log-probs
    been read one token off, it would be far from 0."""
    model = str(warmed_up / "agent-sft")
    raw = task_config(tmp_path, algorithm={"distill": {"teacher": model, "cpu_kv_cache_gib": 0.05}},
                      eval={"every": 0, "sets": [{"name": "held_out"}]})  # fmt: skip
    raw["model"]["path"] = model
    config = tmp_path / "distill.yaml"
    config.write_text(yaml.safe_dump(raw))
    code, out = train_here(capfd, config)
    assert code == 0, out[-3000:]
    assert "1 teacher engine(s) (vLLM)" in out
    rows = [json.loads(line) for line in (tmp_path / "outputs" / "agent" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    print(
        "reverse KL per step",
        [row["distill/reverse_kl"] for row in rows],
        "turns",
        [row["agent/turns"] for row in rows],
    )
    for row in rows:
        assert row["agent/tool_calls"] > 0 and row["agent/turns"] > 1  # trajectories with the tool's answers in them
        assert row["distill/unscored"] == 0 and row["distill/teacher_seconds"] > 0
        assert abs(row["distill/reverse_kl"]) < 1e-3, row["distill/reverse_kl"]


@pytest.mark.slow
def test_an_agent_written_against_the_openai_client_produces_token_exact_trajectories(ray_cluster, warmed_up, tmp_path):
    """`environment.agent`: the agent calls the generator's endpoint with the real `openai` client, runs the
    calculator on the tool calls it gets back and sends the results; its calls make one trajectory each, exact
    token for token, with its reward. An agent that rewrites its history is answered, and only its first call
    is trained (`diverged`)."""
    from grpo_dist.agents.render import Renderer

    environment = {"agent": "agent_fixtures.calculator_agent", "tools": []}
    config, pool, placement, _, prompts, tokenizer = start_pool(warmed_up, environment, tmp_path)
    try:
        completions = [c for group in run_to_end(pool.start(prompts[:2], 2, seeds=[5, 6])) for c in group]
        schema = {"type": "function", "function": {"name": "calculator", "parameters": {}}}
        renderer = Renderer(tokenizer, [schema])
        for completion in completions:
            episode = completion.episode
            assert episode.turns >= 1 and not episode.diverged
            assert episode.rewards["asked"] <= episode.tool_calls and episode.rewards["asked"] in range(4)
            assert episode.turns - episode.rewards["asked"] in (0, 1)  # every reply but a last one without a call asked
            assert_token_exact(pool.actors[0], completion, renderer)
        assert any(c.episode.turns >= 2 for c in completions), [c.episode.messages for c in completions]
    finally:
        pool.shutdown()
        placement.remove()
    environment = {"agent": "agent_fixtures.rewriting_agent", "tools": []}
    config, pool, placement, _, prompts, tokenizer = start_pool(warmed_up, environment, tmp_path / "rewriting")
    try:
        (completion, _) = run_to_end(pool.start(prompts[:1], 2, seeds=[7]))[0]
        assert completion.episode.diverged and completion.episode.turns == 1
        assert completion.mask == [1] * len(completion.token_ids)  # the first call alone
    finally:
        pool.shutdown()
        placement.remove()


@pytest.mark.slow
def test_an_llm_judges_verdict_is_a_reward_function_weighted_with_the_others(ray_cluster, warmed_up, tmp_path):
    """`reward.judge`: an engine of the judge model (here the warmed-up calculator model, whose reply to a product
    is a tool call) reads each completion through `reward.judge.prompt`; the first digit in its greedy reply,
    divided by 10, is the reward function `judge`, weighted into the total with the others.
    The verdicts equal those of the same model decoded greedily by transformers; a reply without one is unscored,
    saying so."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_dist.cluster.placement import place
    from grpo_dist.cluster.reward_pool import RewardPool
    from grpo_dist.faults import FaultLog
    from grpo_dist.types import ScoreRequest

    model = str(warmed_up / "agent-sft")
    judge = {"model": model, "prompt": "{completion}", "verdict": r"([0-9])", "scale": 10,
             "max_tokens": 90, "max_model_len": 192, "cpu_kv_cache_gib": 0.05, "dtype": "float32"}  # fmt: skip
    raw = small_config(tmp_path, reward={"judge": judge, "functions": [
        {"name": "judge", "weight": 0.5}, {"name": "math_answer", "weight": 1.0}]})  # fmt: skip
    config = validate_config(raw)
    requests = [ScoreRequest("q", text, {"answer": "7"}) for text in ("12*34=", "7", "99*10=", "3*")]
    placement = place(config)
    rewards = RewardPool(config, placement, FaultLog())
    try:
        rewards.pool.wait_ready()
        rewards.judge.pool.wait_ready()
        scores = rewards.score(requests)
        metrics = rewards.step_metrics()
        long = rewards.judge.prompt_tokens(ScoreRequest("q", "7" * 5000, {}))  # cut to fit, the template's end kept
        assert len(long) <= 192 - 90 and rewards.judge.tokenizer.decode(long).endswith("<eos>\n<|assistant|>")
    finally:
        rewards.shutdown()
        placement.remove()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for request, score in zip(requests, scores, strict=True):
        prompt = torch.tensor([rewards.judge.prompt_tokens(request)])
        reply = hf.generate(prompt, max_new_tokens=90, do_sample=False, pad_token_id=0)[0, prompt.shape[1] :]
        expected, why = rewards.judge.verdict(rewards.judge.tokenizer.decode(reply, skip_special_tokens=True))
        correct = 1.0 if request.completion == "7" else 0.0
        if why is None:
            assert score.per_function == [pytest.approx(expected), correct] and not score.failures
            assert score.total == pytest.approx(0.5 * expected + correct)
        else:
            failure = score.failures["judge"]  # the judge's failure, not the completion's: no floor
            assert "no verdict matching reward.judge.verdict" in failure.reason and failure.kind == "unscorable"
            assert math.isnan(score.total)
    assert sum(not math.isnan(score.total) for score in scores) >= 2  # the model writes verdicts for products
    assert metrics["judge/seconds"] > 0 and metrics["reward_failures/judge"] == sum(
        "judge" in score.failures for score in scores
    )
    assert metrics["judge/clamped"] == 0.0  # one digit over 10: within [0, 1]


def test_a_batch_of_trajectories_drawn_ahead_loads_back_from_a_checkpoint(tmp_path):
    """With `rollout.max_staleness` >= 1 the batch drawn ahead is in the checkpoint: trajectories, their masks and
    episodes load back (`weights_only`, with the run state's classes allowed) exactly as they were."""
    import torch

    from grpo_dist.data import PromptRecord
    from grpo_dist.run.checkpoints import RUN_STATE_CLASSES
    from grpo_dist.run.rollouts.rollout import Rollout
    from grpo_dist.storage.safe_load import load
    from grpo_dist.types import Completion, Episode, Score

    episode = Episode([{"role": "user", "content": "2*3="}], turns=2, tool_calls=1, rewards={"step": 0.5})
    completion = Completion(0, [1, 2], [5, 6, 7], "6", [-0.1, 0.0, -0.2], "stop", 3, mask=[1, 0, 1], episode=episode)
    rollout = Rollout([PromptRecord("2*3=", [1, 2])], [completion], [Score(1.0, [1.0])])
    torch.save({"ahead": rollout}, tmp_path / "state.pt")
    assert load(tmp_path / "state.pt", RUN_STATE_CLASSES)["ahead"] == rollout


@pytest.mark.parametrize(
    ("sections", "said"),
    [
        pytest.param({"algorithm": {"overlong": "soft_penalty", "overlong_buffer": 2}}, "use overlong: mask",
                     id="overlong_penalty_of_a_turn"),
        pytest.param({"environment": {"max_total_tokens": 32, "max_turns": 4, "tool_timeout_s": 200}},
                     r"may wait 800 s on its tools .* not less than faults.generate_timeout_s \(600 s\)",
                     id="tools_outlasting_the_generate_bound"),
        pytest.param({"reward": {"functions": [{"name": "judge"}], "judge": {"model": "m", "verdict": "[0-9]+"}}},
                     "has no group", id="verdict_without_a_group"),
        pytest.param({"reward": {"functions": [{"name": "math_answer"}], "judge": {"model": "m"}}},
                     "list its verdict once in reward.functions", id="judge_not_a_reward"),
    ],
)  # fmt: skip
def test_an_agentic_config_that_cannot_run_is_refused_naming_the_keys(tmp_path, sections, said):
    raw = small_config(tmp_path, environment={"max_total_tokens": 32}, data={"max_prompt_tokens": 16})
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    with pytest.raises(ConfigError, match=said):
        validate_config(raw)


def test_the_agent_rewards_and_metrics_read_the_episode():
    """`tool_use` is 1 only when tools were called and none answered an error; `environment` is the environment's
    reward parts summed; the step's agent metrics are per-trajectory means over the batch (single-turn completions
    left out)."""
    from grpo_dist.rewards.registry import resolve_reward
    from grpo_dist.run.metrics import episode_metrics
    from grpo_dist.types import Completion, Episode

    worked = [{"role": "user", "content": "2*3="}, {"role": "tool", "content": "6"}]
    failed = [*worked, {"role": "tool", "content": "error: no tool 'calc'"}]
    assert resolve_reward("tool_use")("q", "6", messages=worked) == 1.0
    assert resolve_reward("tool_use")("q", "6", messages=failed) == 0.0
    assert resolve_reward("tool_use")("q", "6", messages=worked[:1]) == 0.0  # no tool called
    assert resolve_reward("environment")("q", "6", environment_reward=0.75) == 0.75

    def completion(episode: Episode | None) -> Completion:
        return Completion(0, [1], [2, 3], "6", [0.0, 0.0], "stop", 0, episode=episode)

    episodes = [Episode(turns=2, tool_calls=2, tool_errors=1, tool_seconds=0.5),
                Episode(turns=1, tool_calls=0, truncated=True, tool_seconds=0.0, diverged=True)]  # fmt: skip
    metrics = episode_metrics([completion(e) for e in episodes] + [completion(None)])
    assert metrics == {
        "agent/turns": 1.5, "agent/tool_calls": 1.0, "agent/tool_errors": 0.5, "agent/tool_error_fraction": 0.5,
        "agent/tool_seconds": 0.25, "agent/tool_seconds_max": 0.5, "agent/truncated_fraction": 0.5,
        "agent/diverged_fraction": 0.5, "agent/failed": 0.0,
    }  # fmt: skip
    assert episode_metrics([completion(None)]) == {}


def test_a_judge_model_that_is_not_there_is_refused_before_anything_starts(tmp_path):
    from grpo_dist.run.inputs import check_judge

    judge = {"model": str(tmp_path / "nowhere"), "verdict": "([0-9])"}
    raw = small_config(tmp_path, reward={"judge": judge, "functions": [{"name": "judge"}]})
    with pytest.raises(ConfigError, match="reward.judge.model: .*nowhere is neither a model directory nor a hub id"):
        check_judge(validate_config(raw))
    (tmp_path / "empty").mkdir()
    raw["reward"]["judge"]["model"] = str(tmp_path / "empty")
    with pytest.raises(ConfigError, match="not a Hugging Face model directory"):
        check_judge(validate_config(raw))
