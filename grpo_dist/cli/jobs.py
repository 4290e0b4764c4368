"""The commands for runs on a Ray cluster: submit one as a Ray job, follow and stop jobs, scale a running run."""

from __future__ import annotations

import argparse
import sys

from grpo_dist.cli.common import Command, config_and_overrides, job_server
from grpo_dist.config import ConfigError


def _submit_arguments(parser: argparse.ArgumentParser) -> None:
    config_and_overrides(
        parser, "YAML config file, inside the working directory", "dotted overrides, e.g. rollout.num_generators=8"
    )
    job_server(parser)
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME",
        help="forward this environment variable into the job (HF_HOME is forwarded when set; "
        "WANDB_API_KEY and HF_TOKEN too with --forward-secrets); values are never printed",
    )
    parser.add_argument(
        "--forward-secrets",
        action="store_true",
        help="forward secrets too (WANDB_API_KEY, HF_TOKEN, AWS keys, --env names holding KEY, TOKEN, "
        "SECRET, ...): Ray writes a job's env vars in plain text to runtime_env_agent.log on every "
        "node; without it, set them in the nodes' own environment",
    )
    parser.add_argument(
        "--working-dir", default=".", help="the files the job gets (default: here, without .venv, outputs and caches)"
    )
    parser.add_argument("--no-follow", action="store_true", help="return once submitted")


def _job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["list", "status", "logs", "stop"])
    parser.add_argument("job_id", nargs="?", help="the job (what submit printed); not with list")
    job_server(parser)
    parser.add_argument("--follow", action="store_true", help="with logs: print them as they grow until the job ends")


def _submit_or_job(args: argparse.Namespace) -> int:
    from grpo_dist.ops.submit import SubmitError, job, submit

    if not args.address:
        raise ConfigError("--address: the Ray job server's URL (http://HEAD:8265) is needed, or RAY_ADDRESS set to it")
    try:
        if args.command == "job":
            if (args.job_id is None) != (args.action == "list"):
                raise ConfigError(
                    f"grpo-dist job {args.action}: " + ("takes no job id" if args.job_id else "name the job")
                )
            return job(args.action, args.job_id, args.address, follow=args.follow)
        return submit(
            args.config,
            args.overrides,
            args.address,
            args.env,
            args.working_dir,
            not args.no_follow,
            args.forward_secrets,
        )
    except SubmitError as err:
        print(f"grpo-dist {args.command}: {err}", file=sys.stderr)
        return 2


def _scale_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="the run's directory (run.output_dir/run.name), or with --address its run.name")
    parser.add_argument("setting", help="generators=N")
    parser.add_argument(
        "--address", default=None, help="the job server of the run's Ray cluster, http://HEAD:8265 (a remote run)"
    )


def _scale_run(run: str, setting: str, address: str | None) -> int:
    from grpo_dist.ops.submit import SubmitError, scale_on_cluster
    from grpo_dist.storage.control import NotRunning, scale

    key, _, value = setting.partition("=")
    if key != "generators" or not value.isdigit() or int(value) < 1:
        print(f"grpo-dist scale: expected generators=N (N >= 1), got {setting!r}", file=sys.stderr)
        return 2
    try:
        if address:
            return scale_on_cluster(run, int(value), address)
        request = scale(run, int(value))
    except (FileNotFoundError, ValueError, NotRunning, SubmitError) as err:
        print(f"grpo-dist scale: {err}", file=sys.stderr)
        return 2
    print(f"asked the run to go to {value} generators ({request}); it does so between two steps and prints it")
    return 0


COMMANDS: dict[str, Command] = {
    "submit": Command(
        "run CONFIG on a Ray cluster as a Ray job and follow its logs", _submit_arguments, _submit_or_job
    ),
    "job": Command(
        "submitted runs: grpo-dist job list --address URL, grpo-dist job status|logs|stop ID --address URL",
        _job_arguments,
        _submit_or_job,
    ),
    "scale": Command(
        "add or remove generators of a running run: grpo-dist scale RUN_DIR generators=N (or RUN_NAME --address URL)",
        _scale_arguments,
        lambda args: _scale_run(args.run, args.setting, args.address),
    ),
}
