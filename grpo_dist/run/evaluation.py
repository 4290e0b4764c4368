"""Evaluation: each eval set's prompts sampled k times on the generators and judged in the reward pool (1.0 =
correct), each under its own bounds; before training, every `eval.every` steps and after the last one. Reported
per set: mean accuracy, the unbiased pass@j for j = 1..k, maj@k where answers can be read, mean length and the
share cut at max_tokens. `grpo-dist sft`, which has no cluster, judges its warm-up in its own sandbox.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from grpo_dist.cluster.cluster import Cluster
from grpo_dist.config import Config, InjectConfig
from grpo_dist.data.prepare import last_boxed
from grpo_dist.rewards.runner import RewardRunner
from grpo_dist.run.inputs import EvalSet
from grpo_dist.run.rollouts import advancing, score_requests
from grpo_dist.storage.console import bar
from grpo_dist.types import Sampling, ScoreRequest

NUMBER = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:/\d+)?")


def evaluate(
    cfg: Config, cluster: Cluster, sets: list[EvalSet], when: str, samples_to: Path | None = None
) -> dict[str, float]:
    """Run every eval set on the generators (holding the weights to evaluate) and judge it in the reward pool;
    one line printed per set; returns `eval/<set>/...` metrics. `samples_to`: a JSON Lines file to write every
    judged sample to (its set, prompt, completion, answer read, correct, length, truncated)."""
    metrics: dict[str, float] = {}
    written = []
    for each in sets:
        sampling = Sampling(each.temperature, each.top_p, each.max_tokens)
        seeds = eval_seeds(cfg.run.seed, each)
        generation = cluster.generators.start(each.prompts, each.k, sampling, seeds)
        with bar(len(each.prompts), f"eval {each.name}", "prompt") as shown:
            for finished in advancing(cluster, generation):
                shown.update(finished)
        completions = generation.completions()
        scores = cluster.rewards.score(score_requests(each.prompts, completions), judge=each.reward)
        samples = [
            Sample(
                score.total == 1.0,
                not math.isfinite(score.total),
                final_answer(c.text),
                len(c.token_ids),
                c.finish_reason == "length",
            )
            for c, score in zip(completions, scores, strict=True)
        ]
        found = set_metrics(each.name, each.k, [samples[i : i + each.k] for i in range(0, len(samples), each.k)])
        metrics.update(found)
        tqdm.write(describe(each, found, when))
        if samples_to is not None:
            written += [
                {
                    "set": each.name,
                    "prompt_index": c.prompt_index,
                    "prompt": each.prompts[c.prompt_index].text,
                    "completion": c.text,
                    **asdict(sample),
                }
                for c, sample in zip(completions, samples, strict=True)
            ]
    if samples_to is not None:
        samples_to.parent.mkdir(parents=True, exist_ok=True)
        samples_to.write_text("".join(json.dumps(row) + "\n" for row in written))
    return metrics


def eval_seeds(run_seed: int, each: EvalSet) -> list[int] | None:
    """One sampling seed per prompt, the same at every evaluation of the run (the same prompts, the same draws:
    what moves between evaluations is the policy); greedy decoding needs none."""
    if each.temperature == 0:
        return None
    stream = random.Random(f"eval:{run_seed}:{each.name}")
    return [stream.getrandbits(31) for _ in each.prompts]


@dataclass(slots=True)
class Sample:
    """One judged eval completion."""

    correct: bool
    unscored: bool  # the judge failed on it (counted wrong)
    answer: str | None  # what majority voting reads from it
    length: int  # tokens
    truncated: bool  # cut at max_tokens


def set_metrics(name: str, k: int, groups: list[list[Sample]]) -> dict[str, float]:
    """A set's metrics from its prompts' groups of k judged samples. A sample the judge failed on counts as
    wrong (and in `unscored`)."""
    samples = [sample for group in groups for sample in group]
    prefix = f"eval/{name}"
    metrics = {f"{prefix}/accuracy": sum(s.correct for s in samples) / len(samples)}
    for j in range(1, k + 1):
        metrics[f"{prefix}/pass@{j}"] = sum(pass_at_k(k, sum(s.correct for s in g), j) for g in groups) / len(groups)
    if k > 1 and any(s.answer is not None for s in samples):
        metrics[f"{prefix}/maj@{k}"] = sum(majority_correct(group) for group in groups) / len(groups)
    metrics[f"{prefix}/length_mean"] = sum(s.length for s in samples) / len(samples)
    metrics[f"{prefix}/truncated"] = sum(s.truncated for s in samples) / len(samples)
    metrics[f"{prefix}/unscored"] = sum(s.unscored for s in samples) / len(samples)
    return metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of the chance that at least one of k samples is correct, from n samples of which c
    are (Chen et al., 2021): 1 - C(n - c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(group: list[Sample]) -> bool:
    """Whether the answer most samples give (the first to reach the top count, among those with an answer) is
    judged correct; False when no sample has an answer."""
    answered = [s for s in group if s.answer is not None]
    if not answered:
        return False
    counts = Counter(s.answer for s in answered)
    top = max(counts.values())
    winner = next(s for s in answered if counts[s.answer] == top)
    return winner.correct


def final_answer(text: str) -> str | None:
    """The answer a completion gives, for majority voting: the last `\\boxed{...}`, else the last number (commas
    dropped), else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def describe(each: EvalSet, metrics: dict[str, float], when: str) -> str:
    """`eval held_out before training: accuracy 0.120, pass@4 0.300, maj@4 0.150 (200 prompts x 4, ...)`."""
    prefix = f"eval/{each.name}"
    shown = [f"accuracy {metrics[f'{prefix}/accuracy']:.3f}"]
    if each.k > 1:
        shown.append(f"pass@{each.k} {metrics[f'{prefix}/pass@{each.k}']:.3f}")
    if f"{prefix}/maj@{each.k}" in metrics:
        shown.append(f"maj@{each.k} {metrics[f'{prefix}/maj@{each.k}']:.3f}")
    samples = f" x {each.k} at temperature {each.temperature:g}" if each.k > 1 else ""
    return (
        f"eval {each.name} {when}: {', '.join(shown)} ({len(each.prompts)} prompts{samples}, judged by {each.reward})"
    )


def judge_accuracy(cfg: Config, requests: list[ScoreRequest], when: str) -> float:
    """The fraction of completions `eval.reward` scores 1.0 (correct), judged without a cluster (`grpo-dist sft`),
    in a sandbox as the reward workers judge; printed with `when` and returned."""
    judge = RewardRunner([cfg.eval.reward], cfg.reward)
    try:
        completions = [(request.prompt, request.completion, request.fields) for request in requests]
        scores = [total for total, _, _ in judge.score_each([0], [1.0], [{}], completions)]
    finally:
        judge.close()
    return show_accuracy(cfg, scores, when)


def show_accuracy(cfg: Config, scores: list[float], when: str) -> float:
    """The fraction of scores that are 1.0 (correct), printed with `when`; a completion the judge failed on counts
    as wrong."""
    accuracy = sum(score == 1.0 for score in scores) / len(scores)
    print(f"held-out accuracy {when}: {accuracy:.3f} ({len(scores)} prompts, judged by {cfg.eval.reward})")
    return accuracy


def eval_config(cfg: Config, scratch: str, model_path: str | None) -> Config:
    """The config `grpo-dist eval` runs with, built from the user's, which is left as it was: its run directory in
    `scratch`, no checkpoint directory, no W&B, no distillation teacher, no injected faults (`faults.inject`: a
    rehearsal of training's faults), and with `model_path` (a saved policy) that as the model."""
    sections = {
        "run": cfg.run.model_copy(update={"output_dir": scratch}),
        "algorithm": cfg.algorithm.model_copy(update={"distill": None}),
        "checkpoint": cfg.checkpoint.model_copy(update={"dir": None}),
        "wandb": cfg.wandb.model_copy(update={"enabled": False}),
        "faults": cfg.faults.model_copy(update={"inject": InjectConfig()}),
    }
    if model_path is not None:
        sections["model"] = cfg.model.model_copy(update={"path": model_path, "tiny": None})
    return cfg.model_copy(update=sections)


def evaluate_checkpoint(cfg: Config, path: str, out: str | None = None, verbose: bool = False) -> dict[str, float]:
    """`grpo-dist eval`: the config's eval sets on the policy at `path` (a checkpoint, verified, on a path every
    learner node sees or in an object store; or a saved policy on such a path: `final/`, `interrupted/`, any
    Hugging Face model directory),
    on a cluster of its own started in a scratch directory (the run's directory is not touched). The metrics are
    printed, and written as JSON to `out` when given. What the libraries and actors print goes to a verbose.log of
    its own, kept and named on the console (and to the console too when `verbose`), as a run's does; where nothing
    was printed there (an eval refused before it started anything), its directory is removed."""
    import shutil
    import tempfile

    from grpo_dist.storage.console import LOG_NAME, Console

    logs = Path(tempfile.mkdtemp(prefix="grpo-dist-eval-log-"))
    print(f"the libraries' and actors' output: {logs / LOG_NAME}" + ("" if verbose else " (--verbose: here too)"))
    console = Console(verbose)
    console.open(logs)
    try:
        return _evaluate_checkpoint(cfg, path, out, console)
    finally:
        console.close()
        if not (logs / LOG_NAME).stat().st_size:
            shutil.rmtree(logs, ignore_errors=True)


def _evaluate_checkpoint(cfg: Config, path: str, out: str | None, console) -> dict[str, float]:
    import tempfile

    from grpo_dist.cluster.cluster import start_cluster
    from grpo_dist.config import ConfigError
    from grpo_dist.config.uris import redact
    from grpo_dist.run import checkpoints
    from grpo_dist.run.inputs import prepare
    from grpo_dist.storage.run_dir import open_run

    policy = path if "://" in path else str(Path(path).resolve())
    hugging_face = "://" not in path and (Path(policy) / "config.json").is_file()
    with tempfile.TemporaryDirectory(prefix="grpo-dist-eval-") as scratch:
        cfg, run = open_run(eval_config(cfg, scratch, policy if hugging_face else None))
        checkpoint = None if hugging_face else checkpoints.find(run, policy, "--checkpoint")
        run.work.mkdir(parents=True, exist_ok=True)
        inputs = prepare(cfg, scratch=Path(scratch) / "inputs")
        if not inputs.eval_sets:
            raise ConfigError("nothing to evaluate: set eval.sets, or data.eval_path (or data.task) for a held-out set")
        cluster = start_cluster(cfg, inputs.model_path, console, run=None)  # nothing written on the learner nodes
        cluster.check_syncs(cfg, [prompt.token_ids for prompt in inputs.train])
        console.take_actor_output()
        try:
            if checkpoint is not None:
                checkpoints.load_learner(cluster.learner, checkpoint, checkpoints.load_state(checkpoint)["step"])
                cluster.sync_weights()
            metrics = evaluate(cfg, cluster, inputs.eval_sets, f"of {redact(policy)}")
        finally:
            cluster.shutdown()
    if out:
        Path(out).write_text(json.dumps({"policy": redact(policy), **metrics}, indent=1) + "\n")
        print(f"eval metrics written to {out}")
    return metrics
