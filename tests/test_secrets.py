"""Secrets stay secret: a URI carrying credentials is refused before anything starts, and the refusal shows it
redacted; the staging directory is never reached through a planted symbolic link nor left to another user; the
agents' chat-completions endpoint answers only its own key, on sessions no one can guess, and a malformed request
with 400. (`grpo-dist submit`'s secrets: tests/test_submit.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import stat

import pytest
from conftest import small_config

from grpo_dist.cli import main
from grpo_dist.config import ConfigError, validate_config
from grpo_dist.config.uris import redact
from grpo_dist.storage import StorageError, Store, StoreError, private_dir

KEY_ID, SECRET = "AKIAEXAMPLEKEYID", "wJalr/XUtnFEMI+K7MDENG?bPxRfiCY"  # a '/' and a '?' as real secret keys hold


@pytest.mark.parametrize(
    ("section", "values", "key", "shown", "found"),
    [
        pytest.param("run", {"output_dir": f"s3://{KEY_ID}:{SECRET}@bucket/runs"}, "run.output_dir",
                     "s3://***@bucket/runs", "a user or password before '@'", id="user_and_password"),
        pytest.param("run", {"output_dir": "hdfs://alice@namenode:8020/runs"}, "run.output_dir",
                     "hdfs://***@namenode:8020/runs", "a user or password before '@'", id="user_only"),
        pytest.param("run", {"output_dir": f"s3://bucket/runs?access_key={KEY_ID}&secret_key={SECRET}&scheme=http"},
                     "run.output_dir", "s3://bucket/runs?access_key=***&secret_key=***", "query parameter 'secret_key'",
                     id="pyarrow_query"),
        pytest.param("run", {"output_dir": f"s3://bucket/runs?session_token={SECRET}"}, "run.output_dir",
                     "s3://bucket/runs?session_token=***", "query parameter 'session_token'", id="session_token"),
        pytest.param("model", {"path": f"gs://bucket/model?access_token={SECRET}"}, "model.path",
                     "gs://bucket/model?access_token=***", "query parameter 'access_token'", id="model_path"),
        pytest.param("eval", {"sets": [{"name": "held", "path": f"https://{KEY_ID}:{SECRET}@host/held.jsonl"}]},
                     "eval.sets.0.path", "https://***@host/held.jsonl", "a user or password", id="eval_set_path"),
    ],
)  # fmt: skip
def test_a_uri_with_credentials_is_refused_naming_the_key_without_showing_them(
    tmp_path, section, values, key, shown, found
):
    raw = small_config(tmp_path, **{section: values})
    raw["checkpoint"] = {"dir": "s3://bucket/elsewhere"}  # a later check's error too: only the first is raised
    with pytest.raises(ConfigError) as refused:
        validate_config(raw)
    message = str(refused.value)
    assert f"{key}: {shown}" in message and found in message
    assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in message and "GOOGLE_APPLICATION_CREDENTIALS" in message
    assert KEY_ID not in message and SECRET not in message and "bPxRfiCY" not in message


@pytest.mark.parametrize(
    "uri, found",
    [
        pytest.param(f"s3://{KEY_ID}:wJal'rXUtn@bucket/runs", "a user or password", id="quote_in_password"),
        pytest.param(f"s3://{KEY_ID}:wJal\"rXUtn@bucket/runs", "a user or password", id="double_quote_in_password"),
        pytest.param(f"s3://{KEY_ID}:wJal rXUtn@bucket/runs", "a user or password", id="blank_in_password"),
        pytest.param("s3://bucket/runs?secret_key=wJal'rXUtn&scheme=http", "query parameter 'secret_key'",
                     id="quote_in_secret_key"),
        pytest.param("s3://bucket/my'runs?secret_key=wJalrXUtn", "query parameter 'secret_key'",
                     id="quote_before_the_query"),
    ],
)  # fmt: skip
def test_a_uri_whose_credentials_hold_a_quote_or_blank_is_refused_without_showing_any_of_it(tmp_path, uri, found):
    """A redaction ends a URI at a blank or a quote, so past one it would show the rest of a secret: such a URI is
    refused without being shown at all."""
    for key, section, field in [("run.output_dir", "run", "output_dir"), ("model.path", "model", "path")]:
        with pytest.raises(ConfigError) as refused:
            validate_config(small_config(tmp_path, **{section: {field: uri}}))
        message = str(refused.value)
        assert f"{key}: the s3:// URI (not shown: it holds a blank or a quote" in message and found in message
        assert KEY_ID not in message and "wJal" not in message and "rXUtn" not in message
    with pytest.raises(StoreError) as refused:
        Store(uri)
    assert "carries credentials" in str(refused.value) and "rXUtn" not in str(refused.value)


@pytest.mark.parametrize("uri", ["s3://bucket/my runs", "s3://bucket/it's"], ids=["blank", "quote"])
def test_an_object_store_uri_with_a_blank_or_a_quote_is_refused(tmp_path, uri):
    with pytest.raises(ConfigError, match=r"run.output_dir: the s3:// URI \(not shown: it holds a blank or a quote"):
        validate_config(small_config(tmp_path, run={"output_dir": uri}))


def test_a_flag_whose_credentials_hold_a_quote_is_refused_without_showing_them(capsys):
    assert main(["train", "CONFIG", "--resume", "s3://bucket/step-1?secret_key=wJal'rXUtn"]) == 2
    err = capsys.readouterr().err
    assert "--resume: the s3:// URI (not shown" in err and "wJal" not in err and "config file not found" not in err


def test_a_uri_with_an_endpoint_but_no_credentials_is_taken(tmp_path):
    uri = "s3://bucket/runs?endpoint_override=127.0.0.1:9000&scheme=http&region=us-east-1"
    assert validate_config(small_config(tmp_path, run={"output_dir": uri})).object_store == uri
    assert redact(uri) == uri


def test_redact_masks_every_credential_in_a_message_and_leaves_the_rest():
    message = f"could not open s3://{KEY_ID}:{SECRET}@bucket/x, nor 'gs://b/y?sas_token=t0k&endpoint_override=h:1'"
    assert redact(message) == "could not open s3://***@bucket/x, nor 'gs://b/y?sas_token=***&endpoint_override=h:1'"


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["train", "CONFIG", "--resume", f"s3://{KEY_ID}:{SECRET}@bucket/runs/grpo/checkpoints/step-1"],
                     id="resume"),
        pytest.param(["eval", "CONFIG", "--checkpoint", f"s3://bucket/step-1?secret_key={SECRET}"], id="eval"),
    ],
)  # fmt: skip
def test_a_flag_with_credentials_is_refused_before_the_config_is_read(capsys, argv):
    assert main(argv) == 2  # CONFIG does not exist: the flag was refused first
    err = capsys.readouterr().err
    assert "carries credentials" in err and "***" in err and "config file not found" not in err
    assert SECRET not in err and KEY_ID not in err


def test_an_object_store_is_never_opened_with_credentials_in_its_uri():
    with pytest.raises(StoreError) as refused:
        Store(f"s3://bucket/runs?secret_key={SECRET}")
    assert "s3://bucket/runs?secret_key=***: carries credentials" in str(refused.value)
    assert SECRET not in str(refused.value)


def test_a_planted_link_in_the_staging_directory_is_refused_and_nothing_goes_through_it(tmp_path):
    target = tmp_path / "theirs"  # where someone else would read the run's checkpoints
    target.mkdir()
    (tmp_path / "staging").symlink_to(target)
    with pytest.raises(StorageError, match=r"staging is a symbolic link \(to .*theirs\)"):
        private_dir(tmp_path / "staging", "run")
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "run").symlink_to(target)  # one level down: the run's own directory
    with pytest.raises(StorageError, match=r"own/run is a symbolic link"):
        private_dir(tmp_path / "own", "run")
    assert list(target.iterdir()) == []


def test_the_staging_directory_is_this_users_alone(tmp_path, monkeypatch):
    made = private_dir(tmp_path / "a" / "staging", "run")  # `a` is created here too, so it is the run's own
    assert made == tmp_path / "a" / "staging" / "run"
    for directory in (tmp_path / "a", tmp_path / "a" / "staging", made):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    private_dir(loose, "run")  # this user's own, once everyone's: brought back to 0o700
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)  # as another user sees these directories
    with pytest.raises(StorageError, match=r"a/staging belongs to another user .*set run.staging_dir"):
        private_dir(tmp_path / "a" / "staging", "run")


# ---- the agents' chat-completions endpoint, without Ray or vLLM: a tiny tokenizer and a scripted sampler


def endpoint_calls(calls):
    """Run `calls(endpoint, base_url, session)` against a started endpoint whose sampler answers "7" and stops."""
    from grpo_dist.agents.endpoint import Endpoint
    from grpo_dist.agents.parsers import hermes
    from grpo_dist.agents.protocol import Limits, Sampled
    from grpo_dist.models.tiny import CHAT_TEMPLATE, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(CHAT_TEMPLATE)

    async def sample(prefix, max_tokens, seed):
        tokens = tokenizer.encode("7", add_special_tokens=False) + [tokenizer.eos_token_id]
        return Sampled(tokens, [-0.5] * len(tokens), "stop", [0] * len(tokens))

    async def run():
        endpoint = Endpoint(tokenizer, hermes, Limits(max_turns=4, max_total_tokens=200, max_new_tokens=8))
        await endpoint.start()
        try:
            base_url = endpoint.open(sample, seed=0)
            return await calls(endpoint, base_url, endpoint.sessions[base_url.rsplit("/", 2)[-2]])
        finally:
            await endpoint.runner.cleanup()

    return asyncio.run(run())


MESSAGES = [{"role": "user", "content": "What is 3 + 4?"}]


def test_an_endpoints_sessions_answer_only_its_key_and_cannot_be_guessed():
    import aiohttp
    import openai

    async def calls(endpoint, base_url, session):
        outsider = openai.AsyncOpenAI(base_url=base_url, api_key="grpo-dist", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await outsider.chat.completions.create(model="policy", messages=MESSAGES)
        async with aiohttp.ClientSession() as http:  # no key at all, on a session that exists
            async with http.post(f"{base_url}/chat/completions", json={"messages": MESSAGES}) as answer:
                unauthorized = (answer.status, (await answer.json())["error"]["type"])
        untouched = (session.calls, list(session.history))
        agent = openai.AsyncOpenAI(base_url=base_url, api_key=endpoint.api_key, max_retries=0)
        reply = await agent.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)
        guessed = openai.AsyncOpenAI(base_url=base_url.replace(base_url.rsplit("/", 2)[-2], "0"),
                                     api_key=endpoint.api_key, max_retries=0)  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            await guessed.chat.completions.create(model="policy", messages=MESSAGES)
        others = {endpoint.open(session.sample, None).rsplit("/", 2)[-2] for _ in range(50)}
        for client in (outsider, agent, guessed):
            await client.close()
        return unauthorized, untouched, reply, session.calls, others, base_url.rsplit("/", 2)[-2]

    unauthorized, untouched, reply, answered, others, name = endpoint_calls(calls)
    assert unauthorized == (401, "authentication_error")
    assert untouched == (0, [])  # the calls without the key wrote nothing into the trajectory
    assert reply.choices[0].message.content == "7" and answered == 1
    assert len(others | {name}) == 51 and all(len(other) >= 22 for other in others)  # 16 random bytes each


@pytest.mark.parametrize(
    ("body", "said"),
    [
        pytest.param(b"{not json", "the body is not JSON", id="not_json"),
        pytest.param(b"\xff\xfe", "the body is not JSON", id="not_text"),
        pytest.param(json.dumps([1, 2]).encode(), "the body must be a JSON object", id="not_an_object"),
        pytest.param(json.dumps({"model": "policy"}).encode(), "messages: at least one message", id="no_messages"),
        pytest.param(json.dumps({"messages": ["hi"]}).encode(), "each message must be an object", id="bad_message"),
        pytest.param(json.dumps({"messages": MESSAGES, "max_tokens": "8"}).encode(), 'max_tokens: a positive integer '
                     '(got "8")', id="max_tokens_text"),
        pytest.param(json.dumps({"messages": MESSAGES, "max_tokens": -1}).encode(), "max_tokens: a positive integer",
                     id="max_tokens_negative"),
        pytest.param(json.dumps({"messages": MESSAGES, "max_tokens": 2.5}).encode(), "max_tokens: a positive integer",
                     id="max_tokens_float"),
        pytest.param(json.dumps({"messages": MESSAGES, "max_completion_tokens": 0}).encode(),
                     "max_completion_tokens: a positive integer", id="max_completion_tokens_zero"),
        pytest.param(json.dumps({"messages": MESSAGES, "tools": "calculator"}).encode(), "tools: a list",
                     id="tools_not_a_list"),
    ],
)  # fmt: skip
def test_a_malformed_request_is_answered_400_with_a_json_error_and_records_nothing(body, said):
    import aiohttp

    async def calls(endpoint, base_url, session):
        headers = {"Authorization": f"Bearer {endpoint.api_key}", "Content-Type": "application/json"}
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{base_url}/chat/completions", data=body, headers=headers) as answer:
                return answer.status, await answer.json(), session.calls

    status, answer, calls_recorded = endpoint_calls(calls)
    assert status == 400 and answer["error"]["type"] == "invalid_request_error" and calls_recorded == 0
    assert said in answer["error"]["message"]
