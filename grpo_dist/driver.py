"""The GRPO loop: prompts -> groups -> rewards -> advantages -> train -> sync -> log.

DeepSeekMath's GRPO (arXiv 2402.03300) with one optimizer update per rollout batch by default (`ppo_epochs` and
`mini_batches` add more), advantages computed here from the group's rewards and sent with the batch to the learner.
Everything that can be wrong with the inputs is checked by `prepare` before any actor starts.
"""

from __future__ import annotations

import logging
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml
from tqdm import tqdm

from grpo_dist import checkpoints, control
from grpo_dist.batch import collate
from grpo_dist.cluster import Cluster, start_ray
from grpo_dist.config import Config, ConfigError
from grpo_dist.data import PromptRecord, PromptSampler, encode_prompts, load_rows, split_task
from grpo_dist.faults import RunFailed
from grpo_dist.learner_group import LearnerGroupError, LearnerLost
from grpo_dist.metrics import MetricsSink, StepTimer, rollout_metrics, start_wandb
from grpo_dist.pipeline import RolloutQueue, bound_staleness, compute_advantages, score_requests, sync_due
from grpo_dist.rewards import resolve_reward, score_one
from grpo_dist.transports import WeightSyncError
from grpo_dist.types import ScoreRequest

log = logging.getLogger("grpo_dist")


@dataclass
class Inputs:
    """Everything a run reads, checked and tokenised."""

    model_path: str
    pad_token_id: int
    train: list[PromptRecord]
    held_out: list[PromptRecord]


def train(cfg: Config, cluster: Cluster | None = None, resume: str | bool = False) -> Path:
    """Run GRPO as configured; returns the run directory (metrics.jsonl, checkpoints/, final/). Starts Ray and the
    actors unless a running `cluster` is given. `resume`: continue from the run's latest checkpoint (True) or
    from the checkpoint at a path."""
    checkpoint = find_checkpoint(cfg, resume)
    earlier = None if checkpoint else start_run_dir(cfg)
    try:
        inputs = prepare(cfg)
    except BaseException:
        if checkpoint is None:
            discard_run_dir(cfg, earlier)
        raise
    own_cluster = cluster is None
    if own_cluster:
        on_sigterm = signal.getsignal(signal.SIGTERM)
        start_ray(cfg)
        if callable(on_sigterm):  # Ray installs a SIGTERM handler that aborts; keep the caller's clean stop
            signal.signal(signal.SIGTERM, on_sigterm)
        cluster = Cluster.start(cfg, inputs.model_path)
    sampler = PromptSampler(inputs.train, cfg.data.prompts_per_step, cfg.run.seed)
    rollouts = RolloutQueue(cfg, cluster, sampler)
    step, wandb_id = resume_from(cluster, rollouts, checkpoint) if checkpoint else (0, None)
    sink = MetricsSink(cfg.run_dir, start_wandb(cfg, cfg.run_dir, wandb_id), after_step=step)
    if step == 0:
        report_accuracy(cfg, cluster, inputs.held_out, "before training")
    at_step_start = (run_state(rollouts, sink), cluster.learner.updates)
    progress = tqdm(total=cfg.run.steps, initial=step, desc="grpo", unit="step", dynamic_ncols=True)
    try:
        while step < cfg.run.steps:
            at_step_start = (run_state(rollouts, sink), cluster.learner.updates)  # for a checkpoint if stopped now
            try:
                apply_scale_request(cfg, cluster)
                metrics = train_step(cfg, cluster, rollouts, inputs.pad_token_id, step + 1)
                step += 1
                sink.log(step, {**metrics, "epoch": sampler.epoch})
                show_progress(cfg, progress, metrics)
                if checkpoint_due(cfg, step):
                    checkpoints.save(cfg, cluster, step, run_state(rollouts, sink))
            except LearnerLost as lost:
                step = restart_learner(cfg, cluster, rollouts, sink, lost)
                progress.n = step
                progress.refresh()
        sink.close()
        if cluster.weight_version < cluster.learner_version:
            cluster.sync_weights()  # the held-out evaluation samples the final policy
        report_accuracy(cfg, cluster, inputs.held_out, "after training")
        if cfg.run.save_final:
            print(f"final policy saved to {cluster.save(str(cfg.run_dir / 'final'))}")
    except BaseException as stop:  # an error, Ctrl-C or SIGTERM (raised as KeyboardInterrupt by the command line)
        if isinstance(stop, KeyboardInterrupt) and step > 0:
            checkpoint_at_stop(cfg, cluster, step, *at_step_start)
        save_interrupted(cluster, cfg.run_dir / "interrupted")
        raise
    finally:
        sink.close()
        progress.close()
        if own_cluster:
            cluster.shutdown()
    return cfg.run_dir


def show_progress(cfg: Config, progress: tqdm, metrics: dict[str, float]) -> None:
    progress.update(1)
    staleness = f" staleness={metrics['staleness/max']:.0f}" if cfg.rollout.max_staleness else ""
    progress.set_postfix_str(
        f"reward={metrics['reward/mean']:.3f} kl={metrics.get('kl', 0.0):.4f} tok/s={metrics['tokens_per_s']:.0f}"
        + staleness
    )


def apply_scale_request(cfg: Config, cluster: Cluster) -> None:
    """Between steps: ask for the generators `grpo-dist scale` asked for, and take in those that have started
    since (a new generator is placed and started while the run goes on). What cannot be done is printed and the
    run goes on with the generators it has."""
    wanted, generators = control.take_request(cfg.run_dir), cluster.generators
    try:
        if wanted is not None and wanted != generators.wanted:
            more = wanted > generators.wanted
            tqdm.write(
                f"scale: {generators.wanted} -> {wanted} generators"
                + ("; new ones join once placed and started, the run going on meanwhile" if more else "")
            )
            cluster.scale_generators(wanted)
            if not more:
                tqdm.write(f"scale: now {len(generators.actors)} generators")
        joined, failed = cluster.admit_generators()
    except LearnerLost:
        raise
    except (WeightSyncError, LearnerGroupError) as err:
        tqdm.write(f"scale: could not connect the generators to the weight transport ({err}); going on")
        return
    for joining, why in failed:
        tqdm.write(f"scale: generator {joining.index} {why}; going on with {len(generators.actors)} generators")
    for joining in joined:
        waited = time.monotonic() - joining.asked
        tqdm.write(f"scale: now {len(generators.actors)} generators (generator {joining.index} joined "
                   f"{waited:.1f} s after it was asked for)")  # fmt: skip


def checkpoint_due(cfg: Config, step: int) -> bool:
    every = cfg.checkpoint.every_steps
    return bool(every) and (step % every == 0 or step == cfg.run.steps)


def checkpoint_at_stop(cfg: Config, cluster: Cluster, step: int, state: dict, updates: int) -> None:
    """On Ctrl-C or SIGTERM, a checkpoint of the last finished step, from the run's state taken when the next step
    began; none when the learner already updated in the step under way (its weights belong to no finished step)."""
    if not cfg.checkpoint.every_steps or (cfg.checkpoint_dir / f"step-{step:06d}").is_dir():
        return
    if cluster.learner.updates != updates or cluster.training is not None:
        print(f"stopped after the learner's update of step {step + 1}: no checkpoint of it; --resume continues "
              "from the latest checkpoint")  # fmt: skip
        return
    try:
        print(f"checkpoint of step {step} written to {checkpoints.save(cfg, cluster, step, state)}")
    except Exception as err:  # the stop is what propagates; this failure is only reported
        log.error("could not write a checkpoint of step %d (%s: %s)", step, type(err).__name__, err)


def restart_learner(cfg: Config, cluster: Cluster, rollouts: RolloutQueue, sink: MetricsSink, lost: LearnerLost) -> int:
    """After a learner rank was lost: a new learner group from the latest checkpoint, the sampler (and the batch
    drawn ahead), random state and metrics back to its step (the steps since are done again). Returns that step."""
    restarts = cluster.faults.counts["learner_restarts"]
    if restarts >= cfg.faults.max_learner_restarts:
        raise RunFailed(
            f"{lost}; the learner group was already restarted {restarts} times (faults.max_learner_restarts)"
        )
    if not (cfg.checkpoint_dir / checkpoints.LATEST).is_file():
        raise RunFailed(f"{lost}; no checkpoint to restart the learner group from yet (checkpoint.every_steps)")
    started = time.monotonic()
    cluster.restart_learner()
    step, _ = resume_from(cluster, rollouts, checkpoints.find(cfg, None))
    sink.rewind(step)
    cluster.faults.record(
        "learner_restarts",
        f"{lost}; restarted the learner group from step {step} in {time.monotonic() - started:.1f} s",
    )
    return step


def find_checkpoint(cfg: Config, resume: str | bool) -> Path | None:
    """The checkpoint a resumed run starts from, after checking the config against it (None: a new run)."""
    if not resume:
        return None
    checkpoint = checkpoints.find(cfg, resume if isinstance(resume, str) else None)
    for change in checkpoints.check_config(cfg, checkpoint):
        print(f"resuming with a changed setting: {change}")
    return checkpoint


def resume_from(cluster: Cluster, rollouts: RolloutQueue, checkpoint: Path) -> tuple[int, str | None]:
    """Load a checkpoint into the learner group, the generators, the sampler (and the batch drawn ahead) and the
    driver's random generators; returns the last step it holds and its W&B run id."""
    state = checkpoints.load_state(checkpoint)
    cluster.learner.load_checkpoint(str(checkpoint / "learner"))
    cluster.learner_version = state["step"]
    cluster.sync_weights()
    rollouts.load_state_dict(state, state["step"])
    checkpoints.restore_random_state(state["random"])
    print(f"resumed from {checkpoint} after step {state['step']}")
    return state["step"], state["wandb_id"]


def run_state(rollouts: RolloutQueue, sink: MetricsSink) -> dict:
    """What the driver carries from step to step, for a checkpoint (the sampler, and the batch drawn ahead)."""
    return {**rollouts.state_dict(), "random": checkpoints.random_state(), "wandb_id": sink.wandb_id}


def start_run_dir(cfg: Config) -> Path | None:
    """Create the run directory and record the resolved config; an earlier run there is moved aside, not lost.
    Returns where the earlier run went (None if there was none)."""
    run_dir = cfg.run_dir
    kept = None
    if run_dir.exists() and any(run_dir.iterdir()):
        kept = run_dir.with_name(f"{run_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(kept)
        print(f"an earlier run in {run_dir} was moved to {kept}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return kept


def discard_run_dir(cfg: Config, earlier: Path | None) -> None:
    """Undo `start_run_dir` after a failed pre-flight check: no new run directory, the earlier run back in place."""
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    if earlier is not None:
        earlier.rename(cfg.run_dir)


def save_interrupted(cluster: Cluster, out_dir: Path) -> None:
    """Save the current policy when a run stops early; a learner that is itself gone is reported, not raised."""
    log.error("training stopped early; saving the current policy to %s", out_dir)
    try:
        cluster.save(str(out_dir))
    except Exception as err:  # the original failure is what propagates; this one is only reported
        log.error("could not save the policy (%s: %s)", type(err).__name__, err)


def train_step(cfg: Config, cluster: Cluster, rollouts: RolloutQueue, pad_token_id: int, step: int) -> dict[str, float]:
    """One GRPO step: take the step's groups (drawn ahead when `rollout.max_staleness` >= 1), compute advantages,
    train while the next step's groups are generated and scored, sync the generators when the bound needs it."""
    timer, started = StepTimer(), time.perf_counter()
    rollout, sampling_metrics = rollouts.take(step, timer)
    rollout, staleness = bound_staleness(rollout, cluster.learner_version, cfg.rollout.max_staleness)
    if not rollout.prompts:  # every group too old: sample afresh (the syncs below keep this from happening)
        rollout, sampling_metrics = rollouts.take(step, timer)
        rollout, staleness = bound_staleness(rollout, cluster.learner_version, cfg.rollout.max_staleness)
    rewards, advantages = compute_advantages(cfg, rollout)  # [B*G] each
    batch = collate(rollout.completions, advantages, pad_token_id, mask_truncated=cfg.algorithm.overlong == "mask")
    with timer("train"):
        cluster.start_train(batch)
        rollouts.draw_ahead(step + 1, timer)
        train_metrics = cluster.finish_train()
    queued = rollouts.queued_prompts()
    if sync_due(cfg, cluster):
        with timer("sync"):
            cluster.sync_weights()
    reward_names = [spec.name for spec in cfg.reward.functions]
    metrics = rollout_metrics(rollout.completions, rollout.scores, advantages, reward_names)
    metrics.update(sampling_metrics, **staleness, **train_metrics, **timer.times, weight_version=cluster.weight_version)
    metrics.update(cluster.rewards.failures.end_step(), **cluster.faults.metrics(), **cluster.generators.step_metrics())
    metrics["reward/shaped_mean"] = rewards.nanmean().item()
    metrics["rollout/groups"] = float(len(rollout.prompts))
    metrics["time/step"] = time.perf_counter() - started
    metrics["time/learner_idle"] = metrics["time/step"] - metrics["time/learner_busy"]
    metrics["time/generator_idle"] = max(0.0, metrics["time/step"] - metrics.get("time/generate", 0.0))
    metrics["queue/prompts"] = float(queued)
    metrics["tokens_per_s"] = metrics["tokens/generated"] / metrics["time/step"]
    return metrics


def report_accuracy(cfg: Config, cluster: Cluster, held_out: list[PromptRecord], when: str) -> float | None:
    """Greedy accuracy on the held-out prompts, judged by `eval.reward` (1.0 = correct); printed and returned."""
    if not held_out:
        return None
    prompts = held_out[: cfg.eval.max_prompts]
    completions = cluster.generators.generate(prompts, group_size=1, greedy=True)
    return judge_accuracy(cfg, score_requests(prompts, completions), when)


def judge_accuracy(cfg: Config, requests: list[ScoreRequest], when: str) -> float:
    """The fraction of completions `eval.reward` scores 1.0 (correct); printed with `when` and returned."""
    judge = [resolve_reward(cfg.eval.reward)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        scores = [
            score_one(judge, [1.0], [{}], r.prompt, r.completion, r.fields, cfg.reward.timeout_s, pool)[0]
            for r in requests
        ]
    accuracy = sum(score == 1.0 for score in scores) / len(scores)
    print(f"held-out accuracy {when}: {accuracy:.3f} ({len(scores)} prompts, judged by {cfg.eval.reward})")
    return accuracy


def prepare(cfg: Config) -> Inputs:
    """Build or check the model, read and tokenise the data, resolve the rewards: fail here, not in an actor."""
    from transformers import AutoTokenizer

    for name in [spec.name for spec in cfg.reward.functions] + [cfg.eval.reward]:
        try:
            resolve_reward(name)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    model_path = prepare_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens > cfg.rollout.max_model_len:
        raise ConfigError(
            f"data.max_prompt_tokens ({cfg.data.max_prompt_tokens}) + rollout.max_new_tokens "
            f"({cfg.rollout.max_new_tokens}) exceeds rollout.max_model_len ({cfg.rollout.max_model_len})"
        )
    train_path, eval_path = prepare_data(cfg)
    train, skipped = read_prompts(cfg, train_path, tokenizer)
    if len(train) < cfg.data.prompts_per_step:
        raise ConfigError(
            f"data.prompts_per_step ({cfg.data.prompts_per_step}) is more than the {len(train)} usable training "
            f"prompts of {train_path}: a step would repeat prompts; lower it or add data"
        )
    if skipped:
        print(f"skipped {skipped} training prompts longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    held_out = read_prompts(cfg, eval_path, tokenizer)[0] if eval_path is not None else []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Inputs(model_path, pad, train, held_out)


def read_prompts(cfg: Config, path: Path, tokenizer) -> tuple[list[PromptRecord], int]:
    """Rows of a dataset file, tokenised; returns the records and how many were over the length limit."""
    field = cfg.data.prompt_field
    return encode_prompts(load_rows(path, field), tokenizer, cfg.data.max_prompt_tokens, prompt_field=field)


def prepare_model(cfg: Config) -> str:
    path = Path(cfg.model.path)
    if cfg.sft is not None and not path.exists():
        raise ConfigError(
            f"model.path: {path} does not exist yet: this config starts from a warmed-up model, which "
            "`grpo-dist sft CONFIG` writes there (see its sft section)"
        )
    return model_directory(cfg, path, "model.path")


def model_directory(cfg: Config, path: Path, key: str) -> str:
    """The Hugging Face model at `path` (config key `key`), built there first when `model.tiny` asks for one."""
    if cfg.model.tiny is not None and not path.exists():
        from grpo_dist.models import build_tiny_model

        build_tiny_model(path, seed=cfg.run.seed, **cfg.model.tiny.model_dump(exclude_none=True))
        print(f"built a random-init tiny model at {path}")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{key}: {path} is not a Hugging Face model directory (no config.json)")
    return str(path.resolve())


def prepare_data(cfg: Config) -> tuple[Path, Path | None]:
    data = cfg.data
    if data.task is None:
        return Path(data.train_path), Path(data.eval_path) if data.eval_path else None
    task = data.task
    return split_task(task.name, cfg.run_dir / "data", task.num_train, task.num_eval, cfg.run.seed)
