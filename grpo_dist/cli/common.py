"""What the command line's groups share: a command's entry, the arguments several take, and the refusals every
command makes before it runs (bad data, credentials in a flag)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from grpo_dist.config import refuse_credentials


@dataclass(frozen=True)
class Command:
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def bad_data_exits_2(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A command that reads the config's data: data it cannot use is bad input, one line and exit 2, as for a bad
    config (`grpo_dist.data` is imported only when such a command runs)."""

    @functools.wraps(run)
    def guarded(args: argparse.Namespace) -> int:
        from grpo_dist.data import DatasetError

        try:
            return run(args)
        except DatasetError as err:
            print(f"grpo-dist: {err}", file=sys.stderr)
            return 2

    return guarded


def config_and_overrides(
    parser: argparse.ArgumentParser, config_help: str | None = None, overrides_help: str | None = None
) -> None:
    parser.add_argument("config", help=config_help)
    parser.add_argument("overrides", nargs="*", help=overrides_help)


def job_server(parser: argparse.ArgumentParser) -> None:
    default = os.environ.get("RAY_ADDRESS") if os.environ.get("RAY_ADDRESS", "").startswith("http") else None
    parser.add_argument(
        "--address",
        default=default,
        help="the Ray job server, http://HEAD:8265 (default: RAY_ADDRESS when it is such a URL)",
    )


FLAGS_WITH_URIS = {
    "resume": "--resume",
    "checkpoint": "--checkpoint",
    "address": "--address",
    "cluster": "--cluster",
    "source": "SOURCE",
}
"""The flags that may name a URI: one carrying credentials is refused (it would be printed and recorded)."""


def refuse_credentials_in_flags(args: argparse.Namespace) -> None:
    """Raise `ConfigError` (shown redacted) when a flag's URI carries a user, password or credential parameter."""
    for attribute, flag in FLAGS_WITH_URIS.items():
        value = getattr(args, attribute, None)
        if isinstance(value, str):
            refuse_credentials(value, flag)
