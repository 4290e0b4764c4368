"""The run's actors by role, placed on the Ray cluster the run joined (`grpo_dist.cluster.ray_cluster`), and the few
calls the driver makes.

Each role is its own module (`grpo_dist.cluster.learner_group`, `grpo_dist.cluster.generator_pool`,
`grpo_dist.cluster.reward_pool`) and owns its state; the cluster joins them with the weight transport, brings a replaced
generator or learner group back into it, and resizes the generator pool on request.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field

from grpo_dist.cluster.generator_pool import GeneratorPool
from grpo_dist.cluster.learner_group import (
    LearnerGroup,
    LearnerGroupError,
    LearnerHung,
    LearnerLost,
    budgeted,
    collective_timeout_s,
)
from grpo_dist.cluster.placement import Placement, place, plan
from grpo_dist.cluster.ray_cluster import (
    start_ray,
    stop_ray,
)
from grpo_dist.cluster.reward_pool import RewardPool
from grpo_dist.cluster.teacher_pool import TeacherPool
from grpo_dist.config import Config, FaultsConfig, InjectConfig
from grpo_dist.faults import RETRY_PAUSE_S, START_ATTEMPTS, Bounds, FaultLog
from grpo_dist.storage import RunStore
from grpo_dist.storage.console import Console, bar, section
from grpo_dist.storage.run_dir import Probe, check_visible, write_probe
from grpo_dist.transports import WeightSyncError, WeightTransport, adapter_slots, make_transport, wire_backend
from grpo_dist.transports.weight_check import ServedWeightsDiffer, WeightCheck

RECONNECT_ATTEMPTS = 3  # a node going down takes its generators one after another

log = logging.getLogger("grpo_dist")


@dataclass
class Cluster:
    """The run's actors, by role (the learner group, the generator pool, the reward pool), their placement groups,
    the weight transport between them, and the log of the faults they survived. Each role owns its state (the
    learner group its version and the step under way, the pool its members and their weights); the cluster joins
    them: it syncs weights, reconnects the transport after a member changed, restarts the learner group and scales
    the pool."""

    cfg: Config
    model_path: str
    learner: LearnerGroup
    generators: GeneratorPool
    rewards: RewardPool
    transport: WeightTransport
    placement: Placement
    faults: FaultLog
    teacher: TeacherPool | None = None  # on-policy distillation's teacher engines (`algorithm.distill`)
    sync_reports: list = field(default_factory=list)  # what the syncs since the last `sync_metrics` sent
    owns_ray: bool = False  # Ray was started (or joined) for this cluster: `shutdown` ends the connection too
    runs: int = 0  # the runs handed these actors (`begin_run`)
    unusable: str | None = None  # why these actors take no other run (handing them to one failed part-way)
    weight_check: WeightCheck | None = None  # the run's check of what the engines serve after a sync (`check_syncs`)
    probe_gaps: list[float] = field(default_factory=list)  # each checked sync's largest gap, since `sync_metrics`

    @classmethod
    def start(cls, cfg: Config, model_path: str, probe: Probe | None = None) -> Cluster:
        """Reserve the placement groups, check that every learner rank's node sees `probe` (a file in the run
        directory, when given), create the actors, wait until every engine is up and connect the weight transport
        (errors surface here, with the actor named). On any failure nothing is left running."""
        placement, faults = place(cfg), FaultLog()
        started: list = []
        shown = bar(4, "starting", "role")  # the learner group, the engines, the reward workers, the transport
        try:
            if probe is not None:
                check_visible(probe, placement.learner_strategies(), Bounds.of(cfg).start)
            generators = GeneratorPool(cfg, model_path, placement, faults)  # the engines start while the learner does
            started.append(generators)
            rewards = RewardPool(cfg, placement, faults)
            started.append(rewards)
            teacher = start_teacher(cfg, placement, faults)
            started += [teacher] if teacher else []
            learner = LearnerGroup.start(cfg, model_path, placement.learner_strategies())
            started.append(learner)
            shown.update()
            generators.pool.wait_ready()
            if teacher is not None:
                teacher.pool.wait_ready()
            shown.update()
            rewards.wait_ready()
            shown.update()
            transport = make_transport(cfg, learner, generators.actors)
            transport.connect()
            shown.update()
        except BaseException:
            for role in started:
                role.shutdown()
            placement.remove()
            raise
        finally:
            shown.close()
        return cls(cfg, model_path, learner, generators, rewards, transport, placement, faults, teacher)

    def check_syncs(self, cfg: Config, prompts: list[list[int]]) -> None:
        """From now on, check after every sync that the engines serve the learner's policy, on a probe made of
        `prompts` (token ids; `grpo_dist.transports.weight_check`), when `sync.probe` is on. Where the engines hold the
        learner's version now, they are probed at once: found serving it, the first sync's move is measured from
        it, as every later one's is from the version before (a first update that moves the policy far, as a
        diverging one does, is not taken for an engine that missed it)."""
        self.weight_check = check = WeightCheck.of(cfg, prompts) if cfg.sync.probe else None
        if check is None or self.generators.weight_version != self.learner.version:
            return
        probe = check.probe(self.learner, self.generators.actors)
        if not probe.mismatch(check.max_gap):
            check.passed(probe)

    def begin_run(self, cfg: Config, model_path: str, fresh: bool) -> None:
        """Hand these actors to a run of `cfg`: the same model, placement and engines (`ActorsDiffer` names what
        differs), the run's own settings applied in every role, what they are built from rebuilt where it changed.
        After an earlier run on them a `fresh` run (no checkpoint to load) starts from the initial model: each learner
        rank's engine rebuilt in its process (the group started afresh when its process settings changed), the
        generators loaded with the initial weights as version 0, new reward workers, faults counted afresh. If this
        fails part-way the actors take no other run."""
        self.check_serves(cfg, model_path)
        earlier, self.runs = self.runs, self.runs + 1
        if not earlier and cfg == self.cfg:
            return  # their first run, of the config they were started with
        try:
            self._apply(cfg, model_path, fresh and earlier > 0, earlier)
        except BaseException as err:
            self.unusable = f"{type(err).__name__}: {err}"
            raise

    def _apply(self, cfg: Config, model_path: str, from_start: bool, earlier: int) -> None:
        old, self.cfg = self.cfg, cfg
        if earlier:
            start = "from the initial model" if from_start else "resuming"
            section(f"the actors of {earlier} earlier run(s) take this one, {start}")
            self.faults.clear()
            self.sync_reports, self.probe_gaps = [], []
        if earlier or reward_settings(cfg) != reward_settings(old):
            self.rewards.shutdown()
            self.rewards = RewardPool(cfg, self.placement, self.faults)
            self.rewards.wait_ready()
        if (
            earlier
            or cfg.algorithm.distill != old.algorithm.distill
            or uninjected_faults(cfg) != uninjected_faults(old)
        ):
            if self.teacher is not None:
                self.teacher.shutdown()
            self.teacher = start_teacher(cfg, self.placement, self.faults)
            if self.teacher is not None:
                self.teacher.pool.wait_ready()
        self.generators.begin_run(cfg, self.faults)
        rebuilt = collective_timeout_s(cfg) != collective_timeout_s(old) or any(
            getattr(cfg.learner, key) != getattr(old.learner, key) for key in LEARNER_PROCESS
        )
        if rebuilt:
            self.learner.shutdown()
            self.learner = LearnerGroup.start(cfg, model_path, self.placement.learner_strategies())
        else:
            if from_start or learner_settings(cfg) != learner_settings(old):
                self.learner.reset(cfg)
                rebuilt = True
            else:
                self.learner.begin_run(cfg)
            self.learner.inject_faults(cfg)
        if earlier or rebuilt or cfg.sync != old.sync:
            self.transport.close()
            self.transport = make_transport(cfg, self.learner, self.generators.actors)
            self.transport.connect()
        if from_start:
            self.transport.sync(0, full=True)
            self.generators.loaded(0)

    def check_serves(self, cfg: Config, model_path: str) -> None:
        """Raise `ActorsDiffer`, naming the settings, when a run of `cfg` needs other actors than these (or when
        handing them to an earlier run failed part-way)."""
        if self.unusable:
            raise ActorsDiffer(f"these actors take no other run: handing them to the last one failed ({self.unusable})")
        differ = differences(self.cfg, self.model_path, cfg, model_path)
        if len(self.generators.actors) != cfg.rollout.num_generators:
            differ.append(f"rollout.num_generators (they run {len(self.generators.actors)})")
        if differ:
            raise ActorsDiffer(f"these actors cannot run this config: {'; '.join(differ)} differ from theirs")

    def sync_weights(self) -> None:
        """Load the learner's current weights (its `version`) into every generator, by the configured transport.
        A sync that fails because a generator is gone or hung is done again once it is replaced; otherwise the
        error is raised (a lost learner rank: `LearnerLost`)."""
        try:
            self._sent(self.transport.sync(self.learner.version))
            self._check_served()
        except (WeightSyncError, LearnerGroupError) as err:
            # A rank that is alive but stuck may be waiting on a generator that hung mid-sync: check them first.
            rank_died = isinstance(err, LearnerLost) and not isinstance(err, LearnerHung)
            if rank_died or not self.generators.replace_unresponsive():
                raise
            self.reconnect()
        self.generators.loaded(self.learner.version)

    def _check_served(self) -> None:
        """Compare what every engine serves with the learner's policy (`grpo_dist.transports.weight_check`). A gap over
        both bounds (`Probe.mismatch`) is a fault: every weight is sent again and checked once more; a gap that stays
        raises `ServedWeightsDiffer`, naming the generator."""
        check, version = self.weight_check, self.learner.version
        if check is None:
            return
        probe = check.probe(self.learner, self.generators.actors)
        if probe.mismatch(check.max_gap):
            self.faults.record(
                "sync_mismatches",
                f"generator {probe.worst} serves other weights than the learner's after the sync of version {version}:"
                f" its log-probabilities of the probe differ from the learner's by {probe.gaps[probe.worst]:.3g} per"
                f" token (over {probe.bounds(check.max_gap)}); sending every weight again",
            )
            self._sent(self.transport.sync(version, full=True))
            probe = check.probe(self.learner, self.generators.actors)
            if probe.mismatch(check.max_gap):
                raise ServedWeightsDiffer(
                    f"generator {probe.worst} serves other weights than the learner's after the sync of version"
                    f" {version} and after every weight was sent again: its log-probabilities of the probe differ"
                    f" from the learner's by {probe.gaps[probe.worst]:.3g} per token, over"
                    f" {probe.bounds(check.max_gap)}. Its engine does not apply what it is sent; training on would"
                    " learn from another policy's samples. If the learner and the engines compute in different"
                    " precisions, raise sync.probe_max_gap"
                )
        check.passed(probe)
        self.probe_gaps.append(probe.gaps[probe.worst])

    def _sent(self, report) -> None:
        if report is not None:
            self.sync_reports.append(report)

    def sync_metrics(self) -> dict[str, float]:
        """What the syncs since the last call sent, where the transport reports it (gloo): `sync/sent_mb` in all,
        `sync/resyncs` (delta syncs done again in full because an engine's copy did not match), and the last one's
        `sync/delta` (1 for a delta) and `sync/changed_fraction` (of every weight's elements); and where syncs were
        checked, `sync/probe_gap`, the largest gap between an engine's log-probabilities and the learner's."""
        reports, self.sync_reports = self.sync_reports, []
        gaps, self.probe_gaps = self.probe_gaps, []
        found = {"sync/probe_gap": max(gaps)} if gaps else {}
        if not reports:
            return found
        return {
            **reports[-1].metrics(),
            **found,
            "sync/sent_mb": sum(report.sent_bytes for report in reports) / 2**20,
            "sync/resyncs": float(sum(report.resync is not None for report in reports)),
        }

    def teacher_metrics(self) -> dict[str, float]:
        """The teacher engines' time and unscored completions since the last call (none without distillation)."""
        return self.teacher.step_metrics() if self.teacher is not None else {}

    def reconnect(self) -> None:
        """Connect the weight transport afresh (after a generator or the learner group was replaced, or the pool
        resized) and load the learner's weights into every generator (after the training step under way, if any);
        a generator lost meanwhile is replaced and the connection made again."""
        self.learner.wait_idle()
        for attempt in range(1, RECONNECT_ATTEMPTS + 1):
            try:
                self.transport = make_transport(self.cfg, self.learner, self.generators.actors)
                self.transport.connect()
                if self.learner.version:
                    self._sent(self.transport.sync(self.learner.version))
                    self._check_served()
                self.generators.loaded(self.learner.version)
                return
            except LearnerLost:
                raise
            except (WeightSyncError, LearnerGroupError):
                if attempt == RECONNECT_ATTEMPTS or not self.generators.replace_unresponsive():
                    raise

    def back_to_initial_model(self) -> None:
        """The learner group back to the initial model with a fresh optimizer (version 0), and every generator loaded
        with it: a rollback before the run's first checkpoint."""
        self.learner.reset(self.cfg)
        self.transport.close()
        self.transport = make_transport(self.cfg, self.learner, self.generators.actors)
        self.transport.connect()
        self.transport.sync(0, full=True)
        self.generators.loaded(0)

    def restart_learner(self) -> None:
        """Replace every learner rank with a fresh one in the same placement (weights: the initial model's; the
        caller loads a checkpoint), then reconnect the transport."""
        self.learner.shutdown()
        self.generators.replace_unresponsive()  # one lost with the learner (the same node) must not stall the sync
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self.learner = LearnerGroup.start(self.cfg, self.model_path, self.placement.learner_strategies())
                break
            except LearnerLost as err:
                if attempt == START_ATTEMPTS or isinstance(err, LearnerHung):
                    raise
                # Placed where a lost rank was, on a node Ray has not yet declared dead: its placement bundle
                # moves to a live node once it has, so start the group again.
                log.warning("%s; starting the learner group again (attempt %d of %d)", err, attempt + 1, START_ATTEMPTS)
                time.sleep(RETRY_PAUSE_S)
        self.transport = make_transport(self.cfg, self.learner, self.generators.actors)
        self.transport.connect()

    def scale(self, wanted: int | None) -> list[str]:
        """Between steps: ask for `wanted` generators (None: no new request), and take in those that have started
        since the last call (each connected to the weight transport and loaded with the learner's weights before it
        takes work); removed ones stop now, new ones join once placed and started, the run going on meanwhile.
        Returns what happened, one line each, to print. What cannot be done is said there and the run goes on with
        the generators it has; a learner rank lost meanwhile is raised (`LearnerLost`)."""
        generators, said = self.generators, []
        try:
            if wanted is not None and wanted != generators.wanted:
                more = wanted > generators.wanted
                later = (
                    "; new ones join once placed and started (Ray's autoscaler asked for their room)" if more else ""
                )
                said.append(f"{generators.wanted} -> {wanted} generators{later}")
                running = len(generators.actors)
                generators.request(wanted)
                if len(generators.actors) != running:
                    self.reconnect()
                if not more:
                    said.append(f"now {len(generators.actors)} generators")
            joined, failed = generators.admit()
            if joined:
                self.reconnect()
        except LearnerLost:
            raise
        except (WeightSyncError, LearnerGroupError) as err:
            return [*said, f"could not connect the generators to the weight transport ({err}); going on"]
        said += [
            f"generator {joining.index} {why}; going on with {len(generators.actors)} generators"
            for joining, why in failed
        ]
        said += [
            f"now {len(generators.actors)} generators (generator {joining.index} joined "
            f"{time.monotonic() - joining.asked:.1f} s after it was asked for)"
            for joining in joined
        ]
        return said

    def save(self, out_dir: str) -> str:
        return self.learner.save(out_dir)

    def shutdown(self) -> None:
        """Stop every actor of the run, and this process's Ray when it was started for the run (a local cluster
        goes with it; a joined one stays up), so a next run in the same process starts afresh."""
        self.learner.shutdown()
        self.generators.shutdown()
        self.rewards.shutdown()
        if self.teacher is not None:
            self.teacher.shutdown()
        self.placement.remove()
        if self.owns_ray:
            stop_ray()


class ActorsDiffer(ValueError):
    """A run's config asks for other actors than the ones it was given (another model, placement or engine)."""


# The learner settings its processes are set up with (`Learner.setup`; the collectives' timeout too): a change starts
# the group afresh.
LEARNER_PROCESS = ("zero_stage", "offload", "dist_backend", "threads")
# The rollout settings each engine is started with (`Generator.__init__`).
ENGINE_SETTINGS = ("max_model_len", "dtype", "gpu_memory_utilization", "enforce_eager", "cpu_kv_cache_gib",
                   "tensor_parallel_size")  # fmt: skip


def start_teacher(cfg: Config, placement: Placement, faults: FaultLog) -> TeacherPool | None:
    """The teacher engines of `algorithm.distill` (starting), or None without distillation."""
    return TeacherPool(cfg, placement, faults) if cfg.algorithm.distill is not None else None


def learner_settings(cfg: Config) -> tuple:
    """What a learner rank is built from (`Learner.__init__`), beside the model."""
    return cfg.learner, cfg.algorithm, budgeted(cfg), cfg.run.seed


def uninjected_faults(cfg: Config) -> FaultsConfig:
    """The fault settings reward workers and teacher engines are built with: the run's, less the faults it injects
    (which only the learner ranks and the generators meet)."""
    return cfg.faults.model_copy(update={"inject": InjectConfig()})


def reward_settings(cfg: Config) -> tuple:
    """What the reward pool is built from."""
    return cfg.reward, cfg.judges, uninjected_faults(cfg)


def differences(cfg: Config, model_path: str, other: Config, other_path: str) -> list[str]:
    """The settings, by name, in which `other` (with its model at `other_path`) asks for other actors than `cfg`:
    another model, placement (`plan`: roles, counts, resources), engine, sampling seed, weight-transfer backend or
    agent environment."""
    found = ["model.path"] if model_path != other_path else []
    if plan(cfg) != plan(other):
        found.append("the placement (learner ranks, generators, reward workers and their resources)")
    found += [f"rollout.{key}" for key in ENGINE_SETTINGS if getattr(cfg.rollout, key) != getattr(other.rollout, key)]
    if cfg.run.seed != other.run.seed:
        found.append("run.seed")
    if wire_backend(cfg) != wire_backend(other):
        found.append("the weight-transfer backend (sync.transport, sync.delta)")
    if adapter_slots(cfg) != adapter_slots(other):
        found.append("the engines' LoRA slots (learner.lora.serve and rank, rollout.max_staleness)")
    agents = (cfg.environment, cfg.reward.isolation, cfg.reward.sandbox_env)
    if agents != (other.environment, other.reward.isolation, other.reward.sandbox_env):
        found.append("environment, reward.isolation or reward.sandbox_env")
    elif cfg.environment is not None and cfg.rollout.max_new_tokens != other.rollout.max_new_tokens:
        found.append("rollout.max_new_tokens (an environment's turns)")
    return found


def start_cluster(cfg: Config, model_path: str, console: Console | None = None, run: RunStore | None = None) -> Cluster:
    """Start (or join) Ray and the run's actors, keeping the caller's SIGTERM handler (Ray installs one that
    aborts; the command line's stops cleanly); with the `run` they write to, every learner node must see it."""
    started = time.perf_counter()
    section(
        f"starting {cfg.learner.num_ranks} learner rank(s), {cfg.rollout.num_generators} generator(s) (vLLM)"
        + (f", {cfg.algorithm.distill.num_engines} teacher engine(s) (vLLM)" if cfg.algorithm.distill else "")
        + f" and {cfg.reward.num_workers} reward worker(s)"
    )
    on_sigterm = signal.getsignal(signal.SIGTERM)
    owns_ray = start_ray(cfg)
    if callable(on_sigterm):
        signal.signal(signal.SIGTERM, on_sigterm)
    if console is not None:
        console.take_actor_output()  # what the actors print while they start, too
    try:
        cluster = Cluster.start(cfg, model_path, probe=write_probe(run) if run else None)
    except BaseException:
        if owns_ray:
            stop_ray()
        raise
    cluster.owns_ray = owns_ray
    if console is not None:
        console.open(cfg.run_dir)  # the libraries imported meanwhile
    section(f"started in {time.perf_counter() - started:.1f} s")
    return cluster
