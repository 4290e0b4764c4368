"""The commands that look without training: check a config (and its fit on a cluster), plan its memory, where a
run stands, a run's picture, the config reference."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from grpo_dist.cli.common import Command, bad_data_exits_2, config_and_overrides
from grpo_dist.config import Config, ConfigError, load_config
from grpo_dist.config.reference import field_docs


def _check_arguments(parser: argparse.ArgumentParser) -> None:
    config_and_overrides(parser)
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


def _plan(args: argparse.Namespace) -> int:
    from grpo_dist.config.plan import check_plan
    from grpo_dist.models.hub import CONFIG_FILES
    from grpo_dist.run.inputs import prepare_model, reward_model_directory, teacher_directory

    cfg = load_config(args.config, args.overrides)
    with tempfile.TemporaryDirectory(prefix="grpo-dist-plan-") as scratch:  # a tiny model is built here
        model = prepare_model(cfg, Path(scratch), CONFIG_FILES)
        teacher, scorer = teacher_directory(cfg, CONFIG_FILES), reward_model_directory(cfg, CONFIG_FILES)
        check_plan(cfg, model, teacher, scorer)
    return 0


def _status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="the run's directory (run.output_dir/run.name), or with --address the job's id")
    parser.add_argument(
        "--address", default=None, help="the job server of the run's Ray cluster, http://HEAD:8265 (a submitted run)"
    )


def _status(args: argparse.Namespace) -> int:
    from grpo_dist.ops.submit import SubmitError, job_status
    from grpo_dist.storage.status import summary

    try:
        lines = job_status(args.run, args.address) if args.address else summary(Path(args.run))
    except (FileNotFoundError, SubmitError) as err:
        print(f"grpo-dist status: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


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
    from grpo_dist.ops.plot import plot_run, reward_summary, step_rewards

    if not Path(args.metrics).is_file():
        raise ConfigError(f"{args.metrics}: no such metrics file (a run writes run.output_dir/run.name/metrics.jsonl)")
    steps, rewards = step_rewards(args.metrics)
    print(f"reward, eval, time per phase and staleness written to {plot_run(args.metrics, args.out)}")
    print(reward_summary(rewards))
    return 0


def _check_inputs(cfg: Config) -> None:
    """Print the resolved config, then resolve and read what it points at as `train` does (a tiny model or a
    bundled task is built in a scratch directory, removed afterwards); raises what `train` would raise."""
    import tempfile
    from pathlib import Path

    import yaml

    from grpo_dist.models.hub import TOKENIZER_FILES
    from grpo_dist.run.inputs import prepare

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

    from grpo_dist.cluster.ray_cluster import unreachable

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
    from grpo_dist.cluster.placement import cluster_nodes, describe, fits

    try:
        nodes = cluster_nodes()
    finally:
        ray.shutdown()
    print(describe(cfg, nodes))
    return 0 if fits(cfg, nodes) else 1


COMMANDS: dict[str, Command] = {
    "check": Command(
        "validate a config (with overrides) and what it points at (model, tokenizer, data, rewards), "
        "print it; starts nothing and writes nothing",
        _check_arguments,
        _check,
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
        "per-GPU memory of the learner ranks and engines: grpo-dist plan CONFIG", config_and_overrides, _plan
    ),
}
