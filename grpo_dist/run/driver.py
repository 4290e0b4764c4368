"""The GRPO loop: prompts -> groups -> rewards -> advantages -> train -> sync -> log.

DeepSeekMath's GRPO (arXiv 2402.03300) with one optimizer update per rollout batch by default (`ppo_epochs` and
`mini_batches` add more), advantages computed here from the group's rewards and sent with the batch to the learner.
Everything that can be wrong with the inputs is checked (`grpo_dist.run.inputs`) before any actor starts. Each concern
has its own module: the batches in `grpo_dist.run.rollouts`, resuming and restarting in `grpo_dist.run.recovery`, the
run directory in `grpo_dist.storage.run_dir`, held-out accuracy in `grpo_dist.run.evaluation`, the actors in
`grpo_dist.cluster.cluster`.
"""

from __future__ import annotations

import time
from pathlib import Path

from tqdm import tqdm

from grpo_dist.algo.batch import collate
from grpo_dist.algo.throughput import StepTimer, throughput_metrics
from grpo_dist.cluster.cluster import Cluster, start_cluster
from grpo_dist.cluster.learner_group import LearnerLost
from grpo_dist.config import Config
from grpo_dist.data import PromptSampler
from grpo_dist.faults import first_line
from grpo_dist.faults.inject import describe as describe_injected
from grpo_dist.run import checkpoints
from grpo_dist.run.autoscale import Autoscaler, Change
from grpo_dist.run.evaluation import evaluate
from grpo_dist.run.health import Guard
from grpo_dist.run.inputs import prepare
from grpo_dist.run.metrics import MetricsSink, StepSamples, completion_rows, rollout_metrics, start_wandb
from grpo_dist.run.recovery import (
    RunFinished,
    check_same_data,
    checkpoint_at_stop,
    find_checkpoint,
    judge_step,
    restart_learner,
    resume_from,
    run_state,
    save_interrupted,
    save_policy,
)
from grpo_dist.run.rollouts import RolloutQueue, add_distillation, bound_staleness, compute_advantages, sync_due
from grpo_dist.storage import RunStore, control, status
from grpo_dist.storage.console import Console, section, step_line
from grpo_dist.storage.run_dir import discard_run_dir, open_run, publish_run_dir, start_run_dir


def train(cfg: Config, cluster: Cluster | None = None, resume: str | bool = False, verbose: bool = False) -> Path:
    """Run GRPO as configured; returns the run directory (metrics.jsonl, checkpoints/, final/). Starts Ray and the
    actors unless a running `cluster` is given. `resume`: continue from the run's latest checkpoint (True) or
    from the checkpoint at a path. `verbose`: the libraries' and actors' output on the console too, not only in
    the run directory's verbose.log."""
    cfg, run = open_run(cfg)
    try:
        checkpoint = find_checkpoint(cfg, run, resume)
    except RunFinished as finished:
        print(f"{finished}; raise run.steps to train on")  # `submit` adds --resume auto: a finished job ends at once
        return run.work
    earlier = None if checkpoint else start_run_dir(cfg, run)
    console = Console(verbose)
    console.open(run.work)
    try:
        return run_training(cfg, run, cluster, checkpoint, earlier, console)
    finally:
        console.close()


def run_training(cfg: Config, run: RunStore, cluster: Cluster | None, checkpoint, earlier, console: Console) -> Path:
    """The run `train` set up (where it lives, `run`): its inputs, its cluster, its steps."""
    try:
        inputs = prepare(cfg)
        if cluster is not None:  # actors given: refused before any run file is kept when they cannot run it
            cluster.check_serves(cfg, inputs.model_path)
    except BaseException:
        if checkpoint is None:
            discard_run_dir(run, earlier)
        raise
    sampler = PromptSampler(inputs.train, cfg.data.prompts_per_step, cfg.run.seed)
    check_same_data(cfg, checkpoint, sampler)
    if injected := describe_injected(cfg.faults.inject):
        section(injected)
    running = control.Running(cfg.run_dir)  # `grpo-dist scale` reaches the run while it holds this
    try:
        return run_steps(cfg, run, cluster, checkpoint, console, inputs, sampler, running)
    finally:
        running.close()


def run_steps(cfg: Config, run: RunStore, cluster: Cluster | None, checkpoint, console: Console, inputs, sampler,
              running: control.Running) -> Path:  # fmt: skip
    """The run's cluster and its steps, from `checkpoint` (or the start), until run.steps or a stop."""
    own_cluster = cluster is None
    cluster = cluster or start_cluster(cfg, inputs.model_path, console, run)
    cluster.begin_run(cfg, inputs.model_path, fresh=checkpoint is None)
    cluster.check_syncs(cfg, [prompt.token_ids for prompt in inputs.train])
    running.open_mailbox(cfg.run.name)
    console.take_actor_output()
    rollouts, guard = RolloutQueue(cfg, cluster, sampler), Guard(cfg.health, clip=cfg.learner.max_grad_norm)
    autoscaler = Autoscaler(cfg.rollout.autoscale)
    step, wandb_id = resume_from(cluster, rollouts, guard, checkpoint) if checkpoint else (0, None)
    sink = MetricsSink(run.work, start_wandb(cfg, run.work, wandb_id), step, cfg.wandb.finish_timeout_s)
    at_step_start = (run_state(rollouts, sink, guard), cluster.learner.version)
    try:
        if step == 0 and inputs.eval_sets:
            sink.log_eval(0, evaluate_now(cfg, cluster, inputs.eval_sets, 0))
        section(f"training: steps {step + 1}-{cfg.run.steps}, one line each")
        change = None  # of the generator count, as the last step's timing calls for (`rollout.autoscale`)
        while step < cfg.run.steps:
            try:
                apply_scale_request(running, cluster, change, sink, step)
                change = None  # taken: one the steps to come call for replaces it
                metrics, samples = train_step(cfg, cluster, rollouts, inputs.pad_token_id, step + 1)
                rolled_back_to = judge_step(cfg, run, cluster, rollouts, sink, guard, step + 1, metrics)
                if rolled_back_to is not None:  # the step was unhealthy: it and the steps since are undone
                    step = rolled_back_to
                else:
                    sink.log(step + 1, {**metrics, **guard.metrics(), "epoch": sampler.epoch}, samples)
                    change = autoscaler.observe(metrics)
                    tqdm.write(step_line(step + 1, cfg.run.steps, metrics, staleness=cfg.rollout.max_staleness > 0))
                    if checkpoint_due(cfg, step + 1):
                        save_checkpoint(cfg, run, cluster, step + 1, run_state(rollouts, sink, guard))
                    step += 1  # done: logged, and checkpointed when due
                    if eval_due(cfg, step) and inputs.eval_sets:
                        sink.log_eval(step, evaluate_now(cfg, cluster, inputs.eval_sets, step))
            except LearnerLost as lost:
                step = restart_learner(cfg, run, cluster, rollouts, sink, guard, lost)
            at_step_start = (run_state(rollouts, sink, guard), cluster.learner.version)  # for a checkpoint if stopped
        sink.close()
        if cfg.run.save_final:
            section(f"final policy saved to {save_policy(run, cluster, 'final')}")
        sink.event("end", step, "finished")
    except BaseException as stop:  # an error, Ctrl-C or SIGTERM (raised as KeyboardInterrupt by the command line)
        why = "interrupted" if isinstance(stop, KeyboardInterrupt) else first_line(stop)
        for message in cluster.faults.take_messages():  # printed in the step that stopped, not yet in the history
            sink.event("fault", step + 1, message)
        sink.event("end", step, f"stopped ({why})")
        if isinstance(stop, KeyboardInterrupt) and step > 0:
            checkpoint_at_stop(cfg, run, cluster, step, *at_step_start)
        save_interrupted(run, cluster)
        raise
    finally:
        sink.close()
        print_summary(run.work, cfg.shown())
        publish_run_dir(run)
        if own_cluster:
            cluster.shutdown()
    return run.work


def print_summary(run_dir: Path, shown: str) -> None:
    """The run's last lines: what `grpo-dist status` says of it (where it is: `shown`)."""
    try:
        print("\n".join(status.summary(run_dir, ended=True, shown=shown)), flush=True)
    except Exception as err:  # the run's own outcome is what matters; this is only reported
        print(f"warning: could not summarise the run ({type(err).__name__}: {err})", flush=True)


def train_step(
    cfg: Config, cluster: Cluster, rollouts: RolloutQueue, pad_token_id: int, step: int
) -> tuple[dict[str, float], StepSamples]:
    """One GRPO step: take the step's groups (drawn ahead when `rollout.max_staleness` >= 1), compute advantages,
    train while the next step's groups are generated and scored, sync the generators when the bound needs it.
    Returns the step's metrics and its samples (for histograms, and the completion table when due)."""
    timer, started = StepTimer(), time.perf_counter()
    k, learner, generators = cfg.rollout.max_staleness, cluster.learner, cluster.generators
    rollout, sampling_metrics = rollouts.take(step, timer)
    rollout, staleness = bound_staleness(rollout, learner.version, k)
    if not rollout.prompts:  # every group too old: sample afresh (the syncs below keep this from happening)
        rollout, sampling_metrics = rollouts.take(step, timer)
        rollout, staleness = bound_staleness(rollout, learner.version, k)
    rewards, advantages = compute_advantages(cfg, rollout)  # [B*G] each
    truncated = cfg.algorithm.overlong == "mask"
    batch = collate(rollout.completions, advantages, pad_token_id, truncated, images=rollout.images())
    batch, distill_metrics = add_distillation(cfg, batch, rollout.completions)  # per-token, from the teacher's view
    with timer("train"):
        learner.start_train(batch)
        rollouts.draw_ahead(step + 1, timer)
        train_metrics = learner.finish_train()
    queued = rollouts.queued_prompts()
    samples = step_samples(cfg, step, rollout, advantages, learner.version - 1)
    if sync_due(k, generators.weight_version, learner.version):
        with timer("sync"):
            cluster.sync_weights()
    reward_names = [spec.name for spec in cfg.reward.functions]
    metrics = rollout_metrics(rollout.completions, rollout.scores, advantages, reward_names)
    metrics.update(
        sampling_metrics, **staleness, **train_metrics, **timer.times, **distill_metrics,
        weight_version=generators.weight_version,
    )  # fmt: skip
    metrics.update(cluster.rewards.step_metrics(), **cluster.faults.metrics(), **generators.step_metrics())
    metrics.update(cluster.sync_metrics(), **cluster.teacher_metrics())
    metrics["reward/shaped_mean"] = rewards.nanmean().item()
    metrics["rollout/groups"] = float(len(rollout.prompts))
    metrics["time/step"] = time.perf_counter() - started
    metrics["time/learner_idle"] = metrics["time/step"] - metrics["time/learner_busy"]
    metrics["time/generator_idle"] = max(0.0, metrics["time/step"] - metrics.get("time/generate", 0.0))
    metrics["queue/prompts"] = float(queued)
    metrics["tokens_per_s"] = metrics["tokens/generated"] / metrics["time/step"]
    metrics.update(throughput_metrics(metrics, len(learner.ranks)))
    return metrics, samples


def step_samples(cfg: Config, step: int, rollout, advantages, version: int) -> StepSamples:
    """The step's rewards, lengths and advantages, and the first groups of its batch when a completion table is due
    (`wandb.table_every`; staleness against `version`, the weights trained on)."""
    every, names = cfg.wandb.table_every, [spec.name for spec in cfg.reward.functions]
    due = bool(every) and (step == 1 or step % every == 0)
    table = completion_rows(rollout, advantages, version, names, cfg.wandb.table_rows) if due else None
    rewards = [score.total for score in rollout.scores]
    return StepSamples(rewards, [c.sampled_tokens for c in rollout.completions], advantages.tolist(), table)


def apply_scale_request(
    running: control.Running, cluster: Cluster, change: Change | None, sink: MetricsSink, step: int
) -> None:
    """Between steps: the generator count `grpo-dist scale` asked for (else the autoscaler's `change`), and the
    generators that have started since, taken in by the cluster; what happened is printed and kept in the run's
    events (the run goes on with the generators it has)."""
    wanted = running.take()
    if wanted is None and change is not None:
        said = f"{len(cluster.generators.actors)} -> {change.wanted} generators: {change.why}"
        tqdm.write(f"autoscale: {said}")
        sink.event("autoscale", step, said)
        wanted = change.wanted
    for line in cluster.scale(wanted):
        tqdm.write(f"scale: {line}")
        sink.event("scale", step, line)


def eval_due(cfg: Config, step: int) -> bool:
    every = cfg.eval.every
    return step == cfg.run.steps or bool(every) and step % every == 0


def evaluate_now(cfg: Config, cluster: Cluster, sets: list, step: int) -> dict[str, float]:
    """The eval sets on the learner's weights of `step` (the generators synced first when behind), timed."""
    started = time.perf_counter()
    if cluster.generators.weight_version < cluster.learner.version:
        cluster.sync_weights()
    when = "before training" if step == 0 else "after training" if step == cfg.run.steps else f"at step {step}"
    metrics = evaluate(cfg, cluster, sets, when, eval_samples(cfg, step))
    return {**metrics, "time/eval": time.perf_counter() - started}


def eval_samples(cfg: Config, step: int) -> Path | None:
    """Where an evaluation's judged samples go (`eval.save_samples`)."""
    return cfg.run_dir / "eval_samples" / f"step-{step:06d}.jsonl" if cfg.eval.save_samples else None


def checkpoint_due(cfg: Config, step: int) -> bool:
    every = cfg.checkpoint.every_steps
    return bool(every) and (step % every == 0 or step == cfg.run.steps)


def save_checkpoint(cfg: Config, run: RunStore, cluster: Cluster, step: int, state: dict) -> None:
    started = time.perf_counter()
    where = checkpoints.save(cfg, run, cluster, step, state)
    section(f"checkpoint of step {step} written to {where} ({time.perf_counter() - started:.1f} s)")
