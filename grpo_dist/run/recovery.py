"""Resuming and restarting: a run resumed from a checkpoint (`--resume`), the learner group restarted from the
latest one after a rank was lost, and what a run keeps when it stops early (a checkpoint of its last finished step,
the current policy in `interrupted/`).

The state a run carries from step to step (`run_state`) is the prompt sampler, the batch drawn ahead with the
sampler from before it, the driver's random generators, the divergence guard's history and the W&B run id; with the
learner's DeepSpeed state it is all a resumed run needs to match the uninterrupted one step for step.

A step the divergence guard (`grpo_dist.run.health`) finds unhealthy is acted on here (`judge_step`): warned of, its
update dropped, the run stopped, or the learner and generators rolled back to the latest checkpoint (`roll_back`),
unless no rollback can be made (`why_no_rollback`: the same cause twice, too many, or nothing to go back to short
of throwing the run's progress away), when the run stops saying why.
"""

from __future__ import annotations

import logging
import time

from tqdm import tqdm

from grpo_dist.cluster.cluster import Cluster
from grpo_dist.cluster.learner_group import LearnerLost
from grpo_dist.config import Config, ConfigError
from grpo_dist.data import PromptSampler
from grpo_dist.faults import RunFailed
from grpo_dist.run import checkpoints
from grpo_dist.run.checkpoints import Checkpoint
from grpo_dist.run.health import Event, Guard
from grpo_dist.run.metrics import MetricsSink
from grpo_dist.run.rollouts import RolloutQueue
from grpo_dist.storage import RunStore

log = logging.getLogger("grpo_dist")


def find_checkpoint(cfg: Config, run: RunStore, resume: str | bool) -> Checkpoint | None:
    """The checkpoint a resumed run starts from, after checking the config against it (None: a new run; with
    `resume="auto"`, also when the run has no checkpoint yet). With an object-store run directory, the run's own
    files (metrics so far) are downloaded to go on from."""
    if not resume:
        return None
    if resume == "auto":  # a resubmitted run: go on from where it got to, or start it
        if not checkpoints.has_latest(run):
            print(f"--resume auto: no checkpoint in {run.checkpoints.name(run.checkpoints_key)} yet, so the run starts")
            return None
        resume = True
    checkpoint = checkpoints.find(run, resume if isinstance(resume, str) else None)
    step = checkpoints.load_state(checkpoint)["step"]
    if step >= cfg.run.steps and (not cfg.run.save_final or _final_saved(run)):
        raise RunFinished(f"the run already finished at step {step} (run.steps {cfg.run.steps}): nothing to train")
    for change in checkpoints.check_config(cfg, checkpoint):
        print(f"resuming with a changed setting: {change}")
    run.download_run_files()
    checkpoints.record_resume(run, checkpoint)
    return checkpoint


class RunFinished(Exception):
    """Resuming a run that has trained all its steps and saved its final policy: there is nothing to do."""


def _final_saved(run: RunStore) -> bool:
    """Whether the run's final policy is in its store (published whole: moved into place, or uploaded)."""
    names = run.store.children(f"{run.run}/final")
    return "config.json" in names and any(name.endswith(".safetensors") for name in names)


def check_same_data(cfg: Config, checkpoint: Checkpoint | None, sampler: PromptSampler) -> None:
    """Before anything starts: a resumed run must read the data its checkpoint was written over, or its prompts
    would not be the ones the uninterrupted run draws (`checkpoint.allow_data_change` accepts the change)."""
    if checkpoint is None:
        return
    saved = checkpoints.load_state(checkpoint)["sampler"].get("data")
    if saved is None or saved == sampler.fingerprint():
        return
    if cfg.checkpoint.allow_data_change:
        print("resuming over changed data (checkpoint.allow_data_change): the prompts drawn from here differ")
        return
    raise ConfigError(
        f"--resume from {checkpoint}: the training data changed since it was written (its rows, their order or "
        "their fields, after mapping); resume over the same data, or set checkpoint.allow_data_change=true"
    )


def resume_from(
    cluster: Cluster, rollouts: RolloutQueue, guard: Guard, checkpoint: Checkpoint
) -> tuple[int, str | None]:
    """Load a checkpoint into the learner group, the generators, the sampler (and the batch drawn ahead), the
    divergence guard and the driver's random generators; returns the last step it holds and its W&B run id. Each
    learner node fetches the shards (`Store.fetch`: read in place on a path, downloaded and checked from an object
    store, then removed)."""
    state = checkpoints.load_state(checkpoint)
    checkpoints.load_learner(cluster.learner, checkpoint, state["step"])
    cluster.sync_weights()
    rollouts.load_state_dict(state, state["step"])
    guard.load_state_dict(state.get("health"))
    checkpoints.restore_random_state(state["random"])
    print(f"resumed from {checkpoint} after step {state['step']}")
    return state["step"], state["wandb_id"]


def run_state(rollouts: RolloutQueue, sink: MetricsSink, guard: Guard) -> dict:
    """What the driver carries from step to step, for a checkpoint (the sampler, and the batch drawn ahead)."""
    state = {**rollouts.state_dict(), "random": checkpoints.random_state(), "wandb_id": sink.wandb_id}
    return {**state, "health": guard.state_dict()}


def restart_learner(
    cfg: Config,
    run: RunStore,
    cluster: Cluster,
    rollouts: RolloutQueue,
    sink: MetricsSink,
    guard: Guard,
    lost: LearnerLost,
) -> int:
    """After a learner rank was lost: a new learner group from the latest checkpoint, the sampler (and the batch
    drawn ahead), random state and metrics back to its step (the steps since are done again). Returns that step."""
    step_failed = lost.version + 1
    if lost.kind and cluster.faults.again(("learner", lost.kind, step_failed)):
        advice = what_to_change(cfg, lost.kind)
        raise RunFailed(f"{lost}; the same failure at step {step_failed} a second time: {advice}")
    restarts = cluster.faults.counts["learner_restarts"]
    if restarts >= cfg.faults.max_learner_restarts:
        raise RunFailed(
            f"{lost}; the learner group was already restarted {restarts} times (faults.max_learner_restarts)"
        )
    if not checkpoints.has_latest(run):
        raise RunFailed(f"{lost}; no checkpoint to restart the learner group from yet (checkpoint.every_steps)")
    started = time.monotonic()
    cluster.restart_learner()
    step, _ = resume_from(cluster, rollouts, guard, checkpoints.find(run, None))
    sink.rewind(step)
    cluster.faults.record(
        "learner_restarts",
        f"{lost}; restarted the learner group from step {step} in {time.monotonic() - started:.1f} s",
    )
    return step


WHAT_IS_DONE = {
    "warn": "a warning",
    "skip": "the update was dropped",
    "rollback": "rolling back",
    "stop": "stopping",
}


def judge_step(
    cfg: Config, run: RunStore, cluster: Cluster, rollouts: RolloutQueue, sink: MetricsSink, guard: Guard,
    step: int, metrics: dict[str, float],
) -> int | None:  # fmt: skip
    """The divergence guard's verdict on step `step`, carried out: None when the step stands (what fired printed
    and sent as a W&B alert, counted; its figures join the guard's history), else the step the run was rolled back
    to. A check whose action is `stop` raises `RunFailed` naming the check, the step and the figures."""
    for message in cluster.faults.take_messages():
        sink.event("fault", step, message)
    events = guard.check(step, metrics)
    worst = events[0] if events else None
    cannot = why_no_rollback(cfg, run, sink, guard, worst) if worst and worst.action == "rollback" else ""
    for event in events:
        said = f"{event.what()}: {'stopping' if cannot and event is worst else WHAT_IS_DONE[event.action]}"
        tqdm.write(f"health: step {step}: {said}")
        sink.event("health", step, said)
        sink.alert(f"grpo-dist {cfg.run.name}: health.{event.check}", f"step {step}: {said}")
    if cannot:
        raise RunFailed(f"health: {worst}{cannot}")
    if worst is not None and worst.action == "stop":
        raise RunFailed(f"health: {worst}; stopped (health.{worst.check}.action: stop)")
    if worst is not None and worst.action == "rollback":
        return roll_back(cfg, run, cluster, rollouts, sink, guard, worst)
    for event in events:
        guard.count(event.action)
    guard.record(metrics, events)
    return None


UNDONE_AT_MOST = 2
"""Before a run's first checkpoint, a rollback goes back to the initial model only from one of its first steps:
it then undoes the update that showed in the step that fired, and little else. Later it would throw away every step
so far, which no rollback can restore: the run stops instead, saying so."""


def why_no_rollback(cfg: Config, run: RunStore, sink: MetricsSink, guard: Guard, event: Event) -> str:
    """Why a rollback for `event` cannot be made (the run stops instead), in words to follow the event; empty when
    it can."""
    if guard.again(event):
        return f", again after rolling back from step {event.step}: the same cause twice"
    if guard.counts["rollbacks"] >= cfg.health.max_rollbacks:
        return f"; the run already rolled back {cfg.health.max_rollbacks} times (health.max_rollbacks)"
    if checkpoints.has_latest(run):
        return ""
    if sink.first_step > 0:  # resumed from another run's checkpoint: the initial model is not this run's past
        return (
            f"; this run has written no checkpoint since it resumed at step {sink.first_step}, so there is nothing "
            "of its own to roll back to (checkpoint.every_steps)"
        )
    if event.step > UNDONE_AT_MOST:
        every = cfg.checkpoint.every_steps
        due = f"the first is due at step {every}" if every else "none are written"
        return (
            f"; no checkpoint to roll back to yet ({due}: checkpoint.every_steps), and going back to the initial "
            f"model would throw away steps 1-{event.step - 1}: stopped instead (the policy is saved in interrupted/)"
        )
    return ""


def roll_back(
    cfg: Config, run: RunStore, cluster: Cluster, rollouts: RolloutQueue, sink: MetricsSink, guard: Guard,
    event: Event,
) -> int:  # fmt: skip
    """The learner and the generators back to the latest checkpoint (or the initial model, from one of the run's
    first steps before it has one: `why_no_rollback` says when a rollback cannot be made), the batches trained since
    skipped (the sampler stays past them; a batch drawn ahead is put back), the metrics back to that step, the
    learning rate times `health.rollback_lr_factor`. The checkpoint is written again with the sampler past the
    skipped batches, so that a resumed run does not train on them either. Returns the step."""
    health = cfg.health
    started = time.monotonic()
    rollouts.put_back_ahead()
    if checkpoints.has_latest(run):
        checkpoint = checkpoints.find(run, None)
        state = checkpoints.load_state(checkpoint)
        checkpoints.load_learner(cluster.learner, checkpoint, state["step"])
        cluster.sync_weights()
        to_step, history = state["step"], state.get("health", {}).get("history")
        back_to = f"the checkpoint of step {to_step}"
    else:
        cluster.back_to_initial_model()
        to_step, history, back_to = 0, None, "the initial model (step 0: no checkpoint yet)"
    lowered = ""
    if health.rollback_lr_factor != 1:
        rate = cluster.learner.call("scale_lr", health.rollback_lr_factor)[0]
        lowered = f", the learning rate lowered to {rate:.3g} (health.rollback_lr_factor)"
    sink.rewind(to_step)
    guard.rolled_back(event, history)
    cluster.faults.count("rollbacks")
    undone = event.step - to_step
    skipped = f"step {event.step}" if undone == 1 else f"steps {to_step + 1}-{event.step} ({undone} steps undone)"
    said = f"rolled back to {back_to} in {time.monotonic() - started:.1f} s: the batches of {skipped} skipped{lowered}"
    tqdm.write(f"health: {said}")
    sink.event("health", event.step, said)
    if to_step > 0:
        checkpoints.save(cfg, run, cluster, to_step, run_state(rollouts, sink, guard))
    return to_step


def what_to_change(cfg: Config, kind: str) -> str:
    """The settings that make a training step need less of the device, for a failure seen twice at one step."""
    learner = cfg.learner
    length = (
        f"environment.max_total_tokens (now {cfg.environment.max_total_tokens})"
        if cfg.environment
        else f"rollout.max_new_tokens (now {cfg.rollout.max_new_tokens})"
    )
    if learner.max_tokens_per_micro_batch is not None:
        smaller = f"lower learner.max_tokens_per_micro_batch (now {learner.max_tokens_per_micro_batch}) or {length}"
    else:
        smaller = f"lower learner.micro_batch_size (now {learner.micro_batch_size}) or {length}"
    more = []
    if not learner.gradient_checkpointing:
        more.append("set learner.gradient_checkpointing: true")
    if learner.offload == "none":
        more.append("offload the optimizer (learner.offload: optimizer, with learner.zero_stage >= 1)")
    elif learner.offload == "optimizer" and learner.zero_stage == 3:
        more.append("offload the parameters too (learner.offload: optimizer_and_params)")
    if learner.zero_stage < 3 and learner.num_ranks > 1:
        more.append(f"shard more over the ranks (learner.zero_stage, now {learner.zero_stage})")
    advice = ", ".join([smaller, *more])
    if kind == "out of memory":
        return f"the step needs more memory than the device has; {advice}"
    return f"check the device of that rank (nvidia-smi; Xid errors in the kernel log), or {advice}"


def checkpoint_at_stop(cfg: Config, run: RunStore, cluster: Cluster, step: int, state: dict, version: int) -> None:
    """On Ctrl-C or SIGTERM, a checkpoint of the last finished step `step`, from the run's state taken when the next
    step began (with the learner at `version`); none when the learner has updated since (its weights belong to no
    finished step)."""
    if not cfg.checkpoint.every_steps or checkpoints.written(run, step):
        return
    if cluster.learner.version != version or cluster.learner.busy:
        print(
            f"stopped after the learner's update of step {step + 1}: no checkpoint of it; --resume continues "
            "from the latest checkpoint"
        )
        return
    try:
        print(f"checkpoint of step {step} written to {checkpoints.save(cfg, run, cluster, step, state)}")
    except Exception as err:  # the stop is what propagates; this failure is only reported
        log.error("could not write a checkpoint of step %d (%s: %s)", step, type(err).__name__, err)


def save_policy(run: RunStore, cluster: Cluster, name: str) -> str:
    """The current policy in Hugging Face format as `name` (final, interrupted) in the run's store; returns where
    it is."""
    key = f"{run.run}/{name}"
    return cluster.learner.save(str(run.staged(run.store, key)), run.store, key)


def save_interrupted(run: RunStore, cluster: Cluster) -> None:
    """Save the current policy when a run stops early; a learner that is itself gone is reported, not raised."""
    log.error("training stopped early; saving the current policy as `interrupted` in the run directory")
    try:
        save_policy(run, cluster, "interrupted")
    except Exception as err:  # the original failure is what propagates; this one is only reported
        log.error("could not save the policy (%s: %s)", type(err).__name__, err)
