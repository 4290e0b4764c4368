"""`grpo-dist` command line: train, warm a model up, check a config, build a tiny model, plot a reward curve, merge
an adapter.

Each subcommand is one entry of `COMMANDS`: its help, its arguments and the function that runs it. Only the config
module is imported up front, so `--help` and config errors are instant.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from grpo_dist.config import Config, ConfigError, field_docs, load_config, refuse_credentials
from grpo_dist.console import survive_a_closed_reader


@dataclass(frozen=True)
class Command:
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="grpo-dist", description="Distributed GRPO training on Ray, vLLM and DeepSpeed."
    )
    subcommands = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.arguments(subcommands.add_parser(name, help=command.help))
    args = parser.parse_args(argv)
    if args.command == "train":
        _resume_or_override(args)
    survive_a_closed_reader()  # `grpo-dist train ... | head`: the command goes on to its end, and its exit code
    try:
        return _run(args)
    except ConfigError as err:
        print(f"grpo-dist: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    _refuse_credentials_in_flags(args)
    return COMMANDS[args.command].run(args)


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


def _config_and_overrides(
    parser: argparse.ArgumentParser, config_help: str | None = None, overrides_help: str | None = None
) -> None:
    parser.add_argument("config", help=config_help)
    parser.add_argument("overrides", nargs="*", help=overrides_help)


def _job_server(parser: argparse.ArgumentParser) -> None:
    default = os.environ.get("RAY_ADDRESS") if os.environ.get("RAY_ADDRESS", "").startswith("http") else None
    parser.add_argument(
        "--address",
        default=default,
        help="the Ray job server, http://HEAD:8265 (default: RAY_ADDRESS when it is such a URL)",
    )


# train


def _train_arguments(parser: argparse.ArgumentParser) -> None:
    _config_and_overrides(parser, "YAML config file", "dotted overrides, e.g. learner.lr=5e-6 rollout.group_size=8")
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


def _resume_or_override(args: argparse.Namespace) -> None:
    """`--resume learner.lr=1e-6`: argparse reads the override as --resume's checkpoint; a value with `=` that is
    no existing path is an override, and --resume means the latest checkpoint."""
    resume = args.resume
    if isinstance(resume, str) and "=" in resume and "://" not in resume and not Path(resume).exists():
        args.overrides.append(resume)
        args.resume = True


@bad_data_exits_2
def _train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    from grpo_dist.driver import train
    from grpo_dist.faults import RunFailed
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


# sft, check, eval, plan


def _sft_arguments(parser: argparse.ArgumentParser) -> None:
    _config_and_overrides(parser, "YAML config file with an sft section", "dotted overrides, e.g. sft.steps=200")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing model at model.path")


@bad_data_exits_2
def _sft(args: argparse.Namespace) -> int:
    from grpo_dist.sft import run_sft

    run_sft(load_config(args.config, args.overrides), overwrite=args.overwrite)
    return 0


def _check_arguments(parser: argparse.ArgumentParser) -> None:
    _config_and_overrides(parser)
    parser.add_argument(
        "--cluster",
        metavar="ADDRESS",
        help="also connect to the running Ray cluster at ADDRESS (host:port or auto) and print where each placement "
        "group would go; exit 1 when the run does not fit, 2 when the cluster cannot be reached",
    )


@bad_data_exits_2
def _check(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    _check_inputs(cfg)
    return _check_cluster(cfg, args.cluster) if args.cluster else 0


def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    _config_and_overrides(
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
    from grpo_dist.evaluation import evaluate_checkpoint

    evaluate_checkpoint(load_config(args.config, args.overrides), args.checkpoint, args.out, args.verbose)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from grpo_dist.hub import CONFIG_FILES
    from grpo_dist.inputs import prepare_model, teacher_directory
    from grpo_dist.plan import check_plan

    cfg = load_config(args.config, args.overrides)
    with tempfile.TemporaryDirectory(prefix="grpo-dist-plan-") as scratch:  # a tiny model is built here
        check_plan(cfg, prepare_model(cfg, Path(scratch), CONFIG_FILES), teacher_directory(cfg, CONFIG_FILES))
    return 0


# submit, job, scale


def _submit_arguments(parser: argparse.ArgumentParser) -> None:
    _config_and_overrides(
        parser, "YAML config file, inside the working directory", "dotted overrides, e.g. rollout.num_generators=8"
    )
    _job_server(parser)
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
    _job_server(parser)
    parser.add_argument("--follow", action="store_true", help="with logs: print them as they grow until the job ends")


def _submit_or_job(args: argparse.Namespace) -> int:
    from grpo_dist.submit import SubmitError, job, submit

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


def _status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="the run's directory (run.output_dir/run.name), or with --address the job's id")
    parser.add_argument(
        "--address", default=None, help="the job server of the run's Ray cluster, http://HEAD:8265 (a submitted run)"
    )


def _status(args: argparse.Namespace) -> int:
    from grpo_dist.status import summary
    from grpo_dist.submit import SubmitError, job_status

    try:
        lines = job_status(args.run, args.address) if args.address else summary(Path(args.run))
    except (FileNotFoundError, SubmitError) as err:
        print(f"grpo-dist status: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


# reference, plot, prepare, tiny-model


def reference_text() -> str:
    return "\n".join(f"{key:36} {default:24} {' '.join(doc.split())}" for key, default, doc in field_docs())


def reference_markdown() -> str:
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for key, default, doc in field_docs():
        shown = f"`{default}`" if default else ""
        rows.append(f"| `{key}` | {shown} | {' '.join(doc.split()).replace('|', '/')} |")
    return "\n".join(rows)


def _reference(args: argparse.Namespace) -> int:
    print(reference_markdown() if args.markdown else reference_text())
    return 0


def _plot_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("metrics", help="path to metrics.jsonl")
    parser.add_argument("out", help="PNG to write")


def _plot(args: argparse.Namespace) -> int:
    from grpo_dist.plot import plot_run, reward_summary, step_rewards

    if not Path(args.metrics).is_file():
        raise ConfigError(f"{args.metrics}: no such metrics file (a run writes run.output_dir/run.name/metrics.jsonl)")
    steps, rewards = step_rewards(args.metrics)
    print(f"reward, eval, time per phase and staleness written to {plot_run(args.metrics, args.out)}")
    print(reward_summary(rewards))
    return 0


def _export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("adapter", help="a LoRA adapter directory in PEFT's layout (a run's final/adapter)")
    parser.add_argument("out", help="the directory to write the merged model to (new, or empty)")
    parser.add_argument(
        "--merge", action="store_true", required=True, help="merge the adapter into its base model (the one form)"
    )
    parser.add_argument("--base", help="the base model directory (default: the one the adapter's config names)")


def _export(args: argparse.Namespace) -> int:
    from grpo_dist.export import merge_adapter

    adapted = merge_adapter(Path(args.adapter), Path(args.out), args.base)
    print(f"{adapted} adapted weights merged; the model in {args.out} loads in transformers and vLLM")
    return 0


def _prepare_arguments(parser: argparse.ArgumentParser) -> None:
    from grpo_dist.data.prepare import LAYOUTS

    parser.add_argument("layout", choices=sorted(LAYOUTS))
    parser.add_argument("source", help="a data file, a save_to_disk directory or a hub dataset id")
    parser.add_argument("out", help="JSON Lines file to write")
    parser.add_argument("--split", default=None, help="the split to read (the layout's own by default: gsm8k: train)")
    parser.add_argument("--subset", default=None, help="a hub dataset's subset (the layout's own on its hub id)")
    parser.add_argument("--revision", default=None, help="a hub dataset's branch, tag or commit (main by default)")


@bad_data_exits_2
def _prepare(args: argparse.Namespace) -> int:
    from grpo_dist.data.prepare import prepare

    out, repeated = prepare(args.layout, args.source, args.out, args.split, args.subset, args.revision)
    rows = out.read_text().splitlines()
    columns = ", ".join(json.loads(rows[0])) if rows else "no columns"
    left_out = f"; {repeated} repeated prompts left out" if repeated else ""
    print(f"{len(rows)} rows written to {out} ({columns}){left_out}")
    return 0


def _tiny_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)


def _tiny_model(args: argparse.Namespace) -> int:
    from grpo_dist.models import build_tiny_model

    print(build_tiny_model(args.out_dir, seed=args.seed))
    return 0


def _up(args: argparse.Namespace) -> int:
    from grpo_dist.standing import StandingError, up

    if args.num_cpus is not None and args.num_cpus < 1:
        print(f"grpo-dist up: --num-cpus must be at least 1, not {args.num_cpus}", file=sys.stderr)
        return 2
    try:
        standing, started = up(args.num_cpus)
    except StandingError as err:
        print(f"grpo-dist up: {err}", file=sys.stderr)
        return 1
    said = "started" if started else "already up"
    print(f"local Ray cluster {said} at {standing.address} ({standing.num_cpus} CPUs, files in {standing.temp_dir}):"
          " runs on this machine that name no ray.address join it; `grpo-dist down` stops it")  # fmt: skip
    return 0


def _down(args: argparse.Namespace) -> int:
    from grpo_dist.standing import down, find

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
    "check": Command(
        "validate a config (with overrides) and what it points at (model, tokenizer, data, rewards), "
        "print it; starts nothing and writes nothing",
        _check_arguments,
        _check,
    ),
    "eval": Command(
        "the config's eval sets on a checkpoint or saved policy: grpo-dist eval CONFIG --checkpoint PATH",
        _eval_arguments,
        _eval,
    ),
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
    "status": Command(
        "where a run stands: grpo-dist status RUN_DIR (or --address URL JOB_ID for a submitted run)",
        _status_arguments,
        _status,
    ),
    "reference": Command(
        "print every config key with its default and meaning",
        lambda parser: parser.add_argument(
            "--markdown", action="store_true", help="as a Markdown table (the site's configuration page)"
        ),
        _reference,
    ),
    "plot": Command("draw a run's reward, eval curves, time per phase and staleness as a PNG", _plot_arguments, _plot),
    "plan": Command(
        "per-GPU memory of the learner ranks and engines: grpo-dist plan CONFIG", _config_and_overrides, _plan
    ),
    "export": Command(
        "a LoRA adapter merged into its base model: grpo-dist export ADAPTER_DIR OUT_DIR --merge [--base MODEL_DIR]",
        _export_arguments,
        _export,
    ),
    "prepare": Command(
        "a recipe's dataset as the rows a run reads: grpo-dist prepare gsm8k|math|dapo-math|aime|mbpp SOURCE OUT.jsonl",
        _prepare_arguments,
        _prepare,
    ),
    "up": Command(
        "keep a local Ray cluster up for the runs on this machine (they join it instead of starting one each)",
        lambda parser: parser.add_argument(
            "--num-cpus", type=int, default=None, help="its logical CPUs (default: the machine's)"
        ),
        _up,
    ),
    "down": Command("stop the local Ray cluster `grpo-dist up` started", lambda parser: None, _down),
    "tiny-model": Command(
        "write a random-init tiny Qwen2 model with a character tokenizer", _tiny_model_arguments, _tiny_model
    ),
}


FLAGS_WITH_URIS = {
    "resume": "--resume",
    "checkpoint": "--checkpoint",
    "address": "--address",
    "cluster": "--cluster",
    "source": "SOURCE",
}
"""The flags that may name a URI: one carrying credentials is refused (it would be printed and recorded)."""


def _refuse_credentials_in_flags(args: argparse.Namespace) -> None:
    """Raise `ConfigError` (shown redacted) when a flag's URI carries a user, password or credential parameter."""
    for attribute, flag in FLAGS_WITH_URIS.items():
        value = getattr(args, attribute, None)
        if isinstance(value, str):
            refuse_credentials(value, flag)


def _scale_run(run: str, setting: str, address: str | None) -> int:
    from grpo_dist.control import NotRunning, scale
    from grpo_dist.submit import SubmitError, scale_on_cluster

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


def _check_inputs(cfg: Config) -> None:
    """Print the resolved config, then resolve and read what it points at as `train` does (a tiny model or a
    bundled task is built in a scratch directory, removed afterwards); raises what `train` would raise."""
    import tempfile
    from pathlib import Path

    import yaml

    from grpo_dist.hub import TOKENIZER_FILES
    from grpo_dist.inputs import prepare

    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    with tempfile.TemporaryDirectory(prefix="grpo-dist-check-") as scratch:
        inputs = prepare(cfg, scratch=Path(scratch), model_files=TOKENIZER_FILES)
    sets = ", ".join(f"{each.name} ({len(each.prompts)} prompts)" for each in inputs.eval_sets) or "none"
    print(
        f"inputs: {len(inputs.train)} training prompts, eval sets {sets}, rewards "
        f"{', '.join(spec.name for spec in cfg.reward.functions)} resolved"
    )


def _check_cluster(cfg: Config, address: str) -> int:
    """Print the placement plan of `cfg` on the Ray cluster at `address`: 0 if it fits, 1 if not, 2 if the cluster
    cannot be reached. Every step is bounded: a TCP probe of the address first, then one connection attempt."""
    import ray

    from grpo_dist.cluster import unreachable

    problem = unreachable(address)
    if problem is None:
        os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "1")  # one attempt (~40 s), not Ray's 20
        try:
            ray.init(address=address, logging_level="warning", log_to_driver=False)
        except (ConnectionError, ValueError, ray.exceptions.RayError) as err:
            problem = f"{type(err).__name__}: {err}"
    if problem is not None:
        print(
            f"grpo-dist: cannot connect to the Ray cluster at {address}: {problem}\n"
            "Is it running (`ray status` on its head node) and is the address the head's GCS address (port 6379 by "
            "default)? A cluster started with token authentication needs RAY_AUTH_MODE=token and its token in "
            "~/.ray/auth_token (or RAY_AUTH_TOKEN) here too.",
            file=sys.stderr,
        )
        return 2
    from grpo_dist.placement import cluster_nodes, describe, fits

    try:
        nodes = cluster_nodes()
    finally:
        ray.shutdown()
    print(describe(cfg, nodes))
    return 0 if fits(cfg, nodes) else 1


if __name__ == "__main__":
    sys.exit(main())
