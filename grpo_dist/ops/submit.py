"""Submitting a run to a Ray cluster as a Ray job (Ray's Job Submission SDK), and following, inspecting or stopping
it: `grpo-dist submit CONFIG --address URL`, `grpo-dist job status|logs|stop ID`.

The config is validated here before anything is sent. The job's files are the working directory (`--working-dir`,
the current one by default) without local environments, runs and caches; grpo-dist itself comes from the cluster's
image. Named environment variables are forwarded into the job (HF_HOME by default, when set, and with an object store
its endpoint and region); their values are never printed. Secrets (WANDB_API_KEY, HF_TOKEN, AWS keys, any name
holding KEY, TOKEN, SECRET, PASSWORD or CREDENTIAL) are not forwarded unless `--forward-secrets` is given: Ray 2.60
writes a job's runtime_env env_vars in plain text to runtime_env_agent.log on every node. Without it, the secrets set
here are named (not shown) as not forwarded, to be set in the nodes' own environment (a Kubernetes Secret mounted as
env vars in the KubeRay pod spec). A submitted run needs an absolute `run.output_dir` on storage every node mounts: a
relative one would land in the job's temporary working directory. With token authentication (Ray 2.60 starts the
job server with it when `RAY_AUTH_MODE=token`), the token is read from `RAY_AUTH_TOKEN` or `~/.ray/auth_token`; a
missing or wrong one is a one-line error saying what to set.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from grpo_dist.config import ConfigError, load_config
from grpo_dist.storage.status import status_from_logs

FORWARDED = ("WANDB_API_KEY", "HF_TOKEN", "HF_HOME")
"""Environment variables forwarded into every job when they are set here (the secrets among them only with
`--forward-secrets`)."""
STORE_CREDENTIALS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
)
"""Forwarded too when they are set here and `run.output_dir` is an object store (every node uploads to it); the
keys only with `--forward-secrets`."""
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
"""A variable whose name says it holds a secret (WANDB_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY, ...)."""
PATHS_TO_SECRETS = ("GOOGLE_APPLICATION_CREDENTIALS", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE")
"""Named like secrets, but they hold the path of a file: not secrets themselves."""
RAY_LOGS_THEM = (
    "Ray writes a job's runtime_env env_vars in plain text to runtime_env_agent.log on every node "
    "(readable by whoever can read the nodes' Ray logs)"
)
ON_THE_CLUSTER = (
    "set them in the nodes' own environment (a Kubernetes Secret mounted as env vars in the KubeRay pod "
    "spec, or the environment `ray start` runs in), or pass --forward-secrets"
)
EXCLUDES = [
    ".venv",
    "outputs",
    "wandb",
    ".git",
    "**/__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    "*.egg-info",
    ".cache",
]
"""What never goes up with the working directory."""
POLL_S = 1.0
STOP_WAIT_S = 600
"""How long Ray waits, after `grpo-dist job stop` sent SIGTERM, before it kills the run (3 s by default)."""
DONE = ("SUCCEEDED", "FAILED", "STOPPED")


class SubmitError(RuntimeError):
    """The cluster could not be reached or refused the request; the message says what to do."""


class JobServer:
    """Ray's job server at `address`, through one Job Submission client; authentication and connection failures
    become one-line `SubmitError`s."""

    def __init__(self, address: str) -> None:
        from ray.exceptions import AuthenticationError
        from ray.job_submission import JobSubmissionClient

        self.address = address
        try:
            self.client = JobSubmissionClient(address)
        except AuthenticationError as err:
            raise SubmitError(self.auth_problem(err)) from None
        except ConnectionError as err:
            raise SubmitError(
                f"cannot reach the Ray job server at {address}: {str(err).splitlines()[0]} (the "
                "head's dashboard address, http://HEAD:8265 by default)"
            ) from None

    def auth_problem(self, err: BaseException) -> str:
        told = "wrong" if "invalid" in str(err).lower() else "missing"
        return (
            f"the Ray job server at {self.address} uses token authentication and the token is {told}: set "
            "RAY_AUTH_TOKEN (or write ~/.ray/auth_token) to the cluster's token, the one its head was started "
            "with"
        )

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        from ray.exceptions import AuthenticationError

        try:
            return getattr(self.client, method)(*args, **kwargs)
        except AuthenticationError as err:
            raise SubmitError(self.auth_problem(err)) from None


def is_secret(name: str) -> bool:
    """Whether the environment variable `name` holds a secret, by its name."""
    return bool(SECRET_NAME.search(name)) and name not in PATHS_TO_SECRETS


def job_environment(env: list[str], object_store: bool, forward_secrets: bool) -> tuple[dict[str, str], list[str]]:
    """The variables the job gets (those set here of the defaults and `env`; secrets only with `forward_secrets`),
    and the secrets set here that it does not get. A variable of `env` that is not set here, or that is a secret
    while `forward_secrets` is not given, is a `ConfigError` (nothing has been sent)."""
    missing = [name for name in env if name not in os.environ]
    if missing:
        raise ConfigError(f"--env {' '.join(missing)}: not set here, so there is nothing to forward")
    asked_secrets = [name for name in env if is_secret(name)]
    if asked_secrets and not forward_secrets:
        raise ConfigError(
            f"--env {' '.join(asked_secrets)}: a secret, by its name, and {RAY_LOGS_THEM}: {ON_THE_CLUSTER}"
        )
    names = list(dict.fromkeys([*FORWARDED, *(STORE_CREDENTIALS if object_store else ()), *env]))
    set_here = [name for name in names if name in os.environ]
    withheld = [] if forward_secrets else [name for name in set_here if is_secret(name)]
    return {name: os.environ[name] for name in set_here if name not in withheld}, withheld


def report_secrets(forwarded: dict[str, str], withheld: list[str]) -> None:
    """One line: the secrets forwarded (and that Ray logs them), or those set here and not forwarded, and what to do
    on the cluster; names only, never values."""
    if sent := sorted(name for name in forwarded if is_secret(name)):
        print(f"warning: --forward-secrets: {', '.join(sent)} forwarded; {RAY_LOGS_THEM}")
    if withheld:
        print(f"not forwarded (secrets: {RAY_LOGS_THEM}): {', '.join(sorted(withheld))}; {ON_THE_CLUSTER}")


def submit(
    config: str,
    overrides: list[str],
    address: str,
    env: list[str],
    working_dir: str,
    follow: bool,
    forward_secrets: bool = False,
) -> int:
    """Validate the config, submit `grpo-dist train` as a job and (with `follow`) print its logs until it ends.
    Secrets go into the job only with `forward_secrets` (`job_environment`). Returns the exit status: 0 when the
    job succeeded (or was submitted, not followed), 1 otherwise."""
    cfg = load_config(config, overrides)
    if not cfg.object_store and not Path(cfg.run.output_dir).is_absolute():
        raise ConfigError(
            f"run.output_dir: {cfg.run.output_dir!r} is relative; a submitted run needs an absolute path that every "
            "node mounts (NFS, Lustre, a PVC): a relative one would land in the job's temporary working directory"
        )
    root = Path(working_dir).resolve()
    try:
        config_in_job = Path(config).resolve().relative_to(root)
    except ValueError:
        raise ConfigError(f"{config} is not inside the working directory {root}, which is what the job gets") from None
    forwarded, withheld = job_environment(env, bool(cfg.object_store), forward_secrets)
    report_secrets(forwarded, withheld)
    # `grpo-dist job stop` is SIGTERM to the run, which then writes a checkpoint; Ray kills it after this wait.
    env_vars = {"RAY_JOB_STOP_WAIT_TIME_S": str(STOP_WAIT_S), **forwarded}
    # --resume auto: a job submitted again (after its driver or head was lost) goes on from its latest checkpoint.
    train = [
        "python",
        "-m",
        "grpo_dist",
        "train",
        str(config_in_job),
        "ray.address=auto",
        *overrides,
        "--resume",
        "auto",
    ]
    entrypoint = shlex.join(train)
    runtime_env = {"working_dir": str(root), "excludes": EXCLUDES, "env_vars": env_vars}
    server = JobServer(address)
    job_id = submit_job(server, entrypoint, runtime_env)
    print(f"submitted {job_id} to {address}: {entrypoint}")
    print(f"forwarded: {', '.join(sorted(forwarded)) or 'no environment variables'} (values not shown)")
    if not follow:
        print(f"follow it with `grpo-dist job logs {job_id} --address {address} --follow`")
        return 0
    return follow_job(server, job_id)


AGENT_WAIT_S = 60.0  # a head just started takes seconds before its job agent takes submissions
ASK_WAIT_S = 120.0  # a scale request's job: start, connect, hand over


def submit_job(server: JobServer, entrypoint: str, runtime_env: dict) -> str:
    """Submit, waiting (at most AGENT_WAIT_S) for a head whose job agent is not up yet; the job's id."""
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            return server.call("submit_job", entrypoint=entrypoint, runtime_env=runtime_env)
        except SubmitError:
            raise
        except RuntimeError as err:
            if "No available agent" not in str(err) or time.monotonic() > deadline:
                raise SubmitError(f"the Ray job server at {server.address} did not take the job: {err}") from None
            time.sleep(2.0)


def follow_job(server: JobServer, job_id: str) -> int:
    """Print the job's logs as they come (the job server streams them) until it ends; its exit status (0:
    succeeded). Ctrl-C stops following, not the job."""

    async def stream() -> None:
        async for lines in server.client.tail_job_logs(job_id):
            sys.stdout.write(lines)
            sys.stdout.flush()

    try:
        asyncio.run(stream())
        while (status := str(server.call("get_job_status", job_id).value)) not in DONE:
            time.sleep(POLL_S)  # the stream ended before the job's status did
    except KeyboardInterrupt:
        print(f"\nstopped following; job {job_id} goes on (`grpo-dist job stop {job_id} --address {server.address}`)")
        return 130
    print(f"job {job_id}: {status}")
    return 0 if status == "SUCCEEDED" else 1


def job(action: str, job_id: str | None, address: str, follow: bool = False) -> int:
    """`grpo-dist job list` and `grpo-dist job status|logs|stop ID`."""
    server = JobServer(address)
    if action == "list":
        return list_jobs(server)
    if action == "status":
        info = server.call("get_job_info", job_id)
        print(f"{job_id}: {info.status.value}" + (f" ({info.message})" if info.message else ""))
        return 0
    if action == "logs":
        if follow:
            return follow_job(server, job_id)
        print(server.call("get_job_logs", job_id), end="")
        return 0
    status = str(server.call("get_job_status", job_id).value)
    if status in DONE:
        raise SubmitError(f"job {job_id} already ended ({status}): there is nothing to stop")
    server.call("stop_job", job_id)
    print(f"{job_id}: asked to stop (it writes a checkpoint and exits)")
    return 0


def job_status(job_id: str, address: str) -> list[str]:
    """`grpo-dist status --address URL JOB_ID`: a submitted run's status from its job's state and console
    (`grpo_dist.storage.status.status_from_logs`)."""
    server = JobServer(address)
    state = str(server.call("get_job_status", job_id).value)
    return status_from_logs(job_id, state, server.call("get_job_logs", job_id))


def list_jobs(server: JobServer) -> int:
    """Every job the cluster knows, oldest first: its id, status, start time and command (a run's config)."""
    jobs = sorted(server.call("list_jobs"), key=lambda info: info.start_time or 0)
    if not jobs:
        print(f"no jobs on the Ray cluster at {server.address}")
    for info in jobs:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.start_time / 1000)) if info.start_time else "-"
        command = info.entrypoint.removeprefix("python -m grpo_dist ")
        print(f"{info.submission_id or info.job_id}  {info.status.value:9}  {started}  {command}")
    return 0


def scale_on_cluster(run_name: str, generators: int, address: str) -> int:
    """`grpo-dist scale RUN_NAME generators=N --address URL`: a small job on the run's cluster hands the request to
    the run's mailbox (`grpo_dist.storage.control`); 0 when the run took it, else a `SubmitError` saying why not."""
    server = JobServer(address)
    entrypoint = shlex.join(["python", "-m", "grpo_dist.storage.control", run_name, str(generators)])
    job_id = submit_job(server, entrypoint, {})
    deadline = time.monotonic() + ASK_WAIT_S
    while (status := str(server.call("get_job_status", job_id).value)) not in DONE:
        if time.monotonic() > deadline:
            server.call("stop_job", job_id)
            raise SubmitError(f"the request job {job_id} did not end within {ASK_WAIT_S:g} s on {address}")
        time.sleep(POLL_S)
    said = server.call("get_job_logs", job_id).strip().splitlines()
    last = said[-1] if said else f"the request job {job_id} printed nothing"
    if status != "SUCCEEDED":
        raise SubmitError(f"{last} (request job {job_id}: {status})")
    print(last)
    return 0
