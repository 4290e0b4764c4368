"""`grpo-dist` command line: train, warm a model up, check a config, build a tiny model, plot a reward curve, merge
an adapter.

Each subcommand is one entry of `COMMANDS`: its help, its arguments and the function that runs it, kept with its
group: `runs` (train, sft, eval, up, down), `checks` (check, plan, status, plot, reference), `jobs` (submit, job,
scale), `files` (export, prepare, tiny-model); `common` holds what they share. Only the config module is imported up
front, so `--help` and config errors are instant.

May import: everything below it (`ops`, `run`, `cluster`, ...); nothing imports it but `__main__`.
"""

from __future__ import annotations

import argparse
import sys

from grpo_dist.cli import checks, files, jobs, runs
from grpo_dist.cli.checks import reference_markdown, reference_text
from grpo_dist.cli.common import Command, refuse_credentials_in_flags
from grpo_dist.config import ConfigError
from grpo_dist.storage.console import survive_a_closed_reader

__all__ = ["COMMANDS", "main", "reference_markdown", "reference_text"]

ORDER = ["train", "sft", "check", "eval", "submit", "job", "scale", "status", "reference", "plot", "plan", "export",
         "prepare", "up", "down", "tiny-model"]  # fmt: skip
"""The subcommands in the order `--help` lists them."""
_BY_NAME = {**runs.COMMANDS, **checks.COMMANDS, **jobs.COMMANDS, **files.COMMANDS}
COMMANDS: dict[str, Command] = {name: _BY_NAME[name] for name in ORDER}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="grpo-dist", description="Distributed GRPO training on Ray, vLLM and DeepSpeed."
    )
    subcommands = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.arguments(subcommands.add_parser(name, help=command.help))
    args = parser.parse_args(argv)
    if args.command == "train":
        runs.resume_or_override(args)
    survive_a_closed_reader()  # `grpo-dist train ... | head`: the command goes on to its end, and its exit code
    try:
        return _run(args)
    except ConfigError as err:
        print(f"grpo-dist: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    refuse_credentials_in_flags(args)
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
