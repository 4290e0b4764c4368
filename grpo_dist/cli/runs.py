"""The commands that run something on this machine: train, sft, eval, and the local Ray cluster runs join (up,
down)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from grpo_dist.cli.common import Command, bad_data_exits_2, config_and_overrides
from grpo_dist.config import load_config


def _train_arguments(parser: argparse.ArgumentParser) -> None:
    config_and_overrides(parser, "YAML config file", "dotted overrides, e.g. learner.lr=5e-6 rollout.group_size=8")
    parser.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="CHECKPOINT",
        help="continue the run in run.output_dir/run.name from its latest checkpoint (or from CHECKPOINT; `auto`: "
        "from its latest one if it has one, else start it)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show what the libraries and actors print (vLLM, DeepSpeed, Ray, warnings) on the console too; it "
        "always goes to verbose.log in the run directory",
    )


def resume_or_override(args: argparse.Namespace) -> None:
    """`--resume learner.lr=1e-6`: argparse reads the override as --resume's checkpoint; a value with `=` that is
    no existing path is an override, and --resume means the latest checkpoint."""
    resume = args.resume
    if isinstance(resume, str) and "=" in resume and "://" not in resume and not Path(resume).exists():
        args.overrides.append(resume)
        args.resume = True


@contextlib.contextmanager
def _warm_if_own_cluster(cfg) -> Iterator[None]:
    """Where the command will start a local cluster of its own (`train`, `eval`), start the warm process its actors
    fork from first thing: it imports the stack while this process prepares the run. It is stopped as the command
    ends, however it ends: a run refused before its cluster started leaves none behind in a process that goes on
    (`grpo_dist.cli.main` called from Python)."""
    from grpo_dist.cluster import ray_cluster, warm

    if ray_cluster.starts_a_cluster_of_its_own(cfg):
        warm.start_for_this_run()
    try:
        yield
    finally:
        warm.stop_for_this_run()


@bad_data_exits_2
def _train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    with _warm_if_own_cluster(cfg):
        return _train_on(cfg, args)


def _train_on(cfg, args: argparse.Namespace) -> int:
    from grpo_dist.run.inputs import hub_model

    hub_model(cfg, say=False, offline_only=True)  # offline, one it cannot have: refused before the driver's imports
    from grpo_dist.faults import RunFailed
    from grpo_dist.run.driver import train
    from grpo_dist.storage import StoreError

    signal.signal(signal.SIGTERM, _stop)  # preemption, `ray job stop`: the same clean stop as Ctrl-C
    try:
        train(cfg, resume=args.resume, verbose=args.verbose)  # its last lines: the summary, naming its directory
    except KeyboardInterrupt:
        print(
            f"grpo-dist: stopped; the policy is in {cfg.shown('interrupted')}, and `grpo-dist train "
            f"{args.config} --resume` continues from the latest checkpoint in {cfg.checkpoints_shown}",
            file=sys.stderr,
        )
        return 130
    except ConnectionError as err:
        print(f"grpo-dist: {err}", file=sys.stderr)
        return 2
    except StoreError as err:  # the storage holding the run stopped answering, or lost part of a checkpoint
        print(f"grpo-dist: the run stopped: {err}", file=sys.stderr)
        return 1
    except RunFailed as err:  # a fault the run could not survive; the message says which and why
        print(
            f"grpo-dist: the run stopped: {err}\nThe policy is in {cfg.shown('interrupted')}; `grpo-dist train "
            f"{args.config} --resume` continues from the latest checkpoint in {cfg.checkpoints_shown}",
            file=sys.stderr,
        )
        return 1
    return 0


def _stop(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _sft_arguments(parser: argparse.ArgumentParser) -> None:
    config_and_overrides(parser, "YAML config file with an sft section", "dotted overrides, e.g. sft.steps=200")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing model at model.path")


@bad_data_exits_2
def _sft(args: argparse.Namespace) -> int:
    from grpo_dist.run.sft import run_sft

    run_sft(load_config(args.config, args.overrides), overwrite=args.overwrite)
    return 0


def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    config_and_overrides(
        parser,
        "YAML config file (its eval sets, data, model shape and cluster)",
        "dotted overrides, e.g. eval.max_prompts=50",
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="a checkpoint directory (checkpoints/step-NNNNNN) or a "
        "saved policy (final/, interrupted/, a Hugging Face model directory)",
    )
    parser.add_argument("--out", default=None, help="also write the metrics to this JSON file")
    parser.add_argument(
        "--verbose", action="store_true", help="show what the libraries and actors print on the console too"
    )


@bad_data_exits_2
def _eval(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    with _warm_if_own_cluster(cfg):
        from grpo_dist.run.evaluation import evaluate_checkpoint

        evaluate_checkpoint(cfg, args.checkpoint, args.out, args.verbose)
    return 0


def _up(args: argparse.Namespace) -> int:
    from grpo_dist.cluster.standing import StandingError, up

    if args.num_cpus is not None and args.num_cpus < 1:
        print(f"grpo-dist up: --num-cpus must be at least 1, not {args.num_cpus}", file=sys.stderr)
        return 2
    try:
        standing, started = up(args.num_cpus, warm_workers=not args.cold)
    except StandingError as err:
        print(f"grpo-dist up: {err}", file=sys.stderr)
        return 1
    said = "started" if started else "already up"
    print(f"local Ray cluster {said} at {standing.address} ({standing.num_cpus} CPUs, files in {standing.temp_dir}):"
          " runs on this machine that name no ray.address join it; `grpo-dist down` stops it")  # fmt: skip
    return 0


def _down(args: argparse.Namespace) -> int:
    from grpo_dist.cluster.standing import down, find

    standing = find()
    stopped = down()
    if standing is None and not stopped:
        print("no local Ray cluster of `grpo-dist up` is up")
    else:
        print(f"local Ray cluster stopped ({stopped} processes)")
    return 0


COMMANDS: dict[str, Command] = {
    "train": Command("run GRPO: grpo-dist train CONFIG [section.key=value ...]", _train_arguments, _train),
    "sft": Command("supervised warm-up writing model.path: grpo-dist sft CONFIG [overrides]", _sft_arguments, _sft),
    "eval": Command(
        "the config's eval sets on a checkpoint or saved policy: grpo-dist eval CONFIG --checkpoint PATH",
        _eval_arguments,
        _eval,
    ),
    "up": Command(
        "keep a local Ray cluster up for the runs on this machine (they join it instead of starting one each)",
        lambda parser: (
            parser.add_argument(
                "--num-cpus", type=int, default=None, help="its logical CPUs (default: the machine's count, at least 8)"
            ),
            parser.add_argument(
                "--cold",
                action="store_true",
                help="start each actor's process as Ray does, importing torch, vLLM and DeepSpeed itself (by default"
                " they are forked from one process that imported them once: README, Runs one after another)",
            ),
        ),
        _up,
    ),
    "down": Command("stop the local Ray cluster `grpo-dist up` started", lambda parser: None, _down),
}
