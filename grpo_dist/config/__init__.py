"""The one typed configuration of a grpo-dist run.

Loaded from YAML with dotted command-line overrides (``learner.lr=5e-6``), validated in full before any actor
starts. This module imports neither torch nor ray, so ``grpo-dist --help`` and config errors are instant.

The sections are `grpo_dist.config.sections`, URIs and their credentials `grpo_dist.config.uris`, the memory plan
`grpo_dist.config.plan`, the reference of every key `grpo_dist.config.reference`. May import: `types` only.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from grpo_dist.config.sections import (  # noqa: F401 (re-exported: the sections are part of the config's API)
    OFF_POLICY_BOUNDS,
    AlgorithmConfig,
    AutoscaleConfig,
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    DistillConfig,
    EnvironmentConfig,
    EvalConfig,
    EvalSetConfig,
    FaultsConfig,
    HealthConfig,
    InjectConfig,
    JudgeConfig,
    LearnerConfig,
    ModelConfig,
    RayConfig,
    RewardConfig,
    RewardFunctionConfig,
    RewardModelConfig,
    RolloutConfig,
    RunConfig,
    SftConfig,
    StepFactor,
    SyncConfig,
    TaskConfig,
    TinyModelConfig,
    WandbConfig,
    _Section,
    engine_rollout,
)
from grpo_dist.config.uris import (
    CREDENTIALS_GO,
    SCHEME,
    URI,
    redact,
    shown_uri,
    uri_credentials,
    uri_join,
)
from grpo_dist.types import RESERVED_FIELDS  # re-exported: the config's checks name it


class ConfigError(ValueError):
    """A configuration that cannot run: the message names the key and what to do."""


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    """Run identity, length and outputs."""
    model: ModelConfig
    """The initial policy."""
    data: DataConfig
    """Prompts and their fields."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Generators and sampling."""
    reward: RewardConfig
    """Reward functions and workers."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantages and loss."""
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    """Optimizer and DeepSpeed."""
    sync: SyncConfig = Field(default_factory=SyncConfig)
    """Weight sync from the learner to the generators."""
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    """What a run survives: bounds on every remote call and how many replacements it may make."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Periodic checkpoints a run resumes from (`grpo-dist train CONFIG --resume`)."""
    health: HealthConfig = Field(default_factory=HealthConfig)
    """What the run checks after every step (a non-finite update, a gradient spike, the KL, the engines' log-prob
    gap, entropy or reward collapsing) and what it does then: warn, roll back, stop."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Evaluation before, during and after training: accuracy, pass@k, maj@k per eval set."""
    environment: EnvironmentConfig | None = None
    """Agentic rollouts: each completion is a multi-turn trajectory in this environment, with tools; null: one
    turn per completion."""
    sft: SftConfig | None = None
    """Supervised warm-up on the task's solved rows (`grpo-dist sft CONFIG`) writing `model.path`; null: none."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """Cluster to run on."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """The hardware the memory plan is checked against."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Experiment tracking."""

    @model_validator(mode="after")
    def _no_credentials_in_uris(self) -> Config:
        """First of the checks, so that no later message can show a secret: every value of the config ends up in
        config.yaml, each checkpoint and the W&B run's config."""
        for key, value in _strings(self.model_dump(mode="json")):
            refuse_credentials(value, key)
        return self

    @model_validator(mode="after")
    def _storage_uris_whole(self) -> Config:
        """A store's URI is printed and joined with keys: it must be one whole URI, which has no blank or quote."""
        for key, value in (("run.output_dir", self.run.output_dir), ("checkpoint.dir", self.checkpoint.dir or "")):
            if SCHEME.match(value) and not URI.fullmatch(value):
                raise ValueError(f"{key}: {shown_uri(value)}: percent-encode it (%20 for a blank, %22 or %27 a quote)")
        return self

    @model_validator(mode="after")
    def _off_policy_resolved(self) -> Config:
        """`old_logprobs`, `is_cap` and `is_floor` for the correction `off_policy` names (their `auto`)."""
        algorithm, off_policy = self.algorithm, self.rollout.max_staleness >= 1
        method, exact = algorithm.off_policy, self.rollout.top_p == 1  # top_p < 1: every sampler ratio below 1
        if algorithm.old_logprobs == "auto":
            sampler = exact and not isinstance(algorithm.is_cap, float) and (
                method == "cispo" or (method == "tis" and off_policy)
            )  # fmt: skip
            algorithm.old_logprobs = "sampler" if sampler else "learner"
        floor, cap = OFF_POLICY_BOUNDS.get(method, (None, None))
        if algorithm.is_cap == "auto":
            learner = algorithm.old_logprobs == "learner" and method != "cispo"
            algorithm.is_cap = cap if learner and (method != "tis" or off_policy) else None
        if algorithm.is_floor == "auto":
            algorithm.is_floor = floor if algorithm.is_cap is not None else None
        if method == "cispo" and algorithm.is_cap is not None:
            raise ValueError(
                f"algorithm.is_cap={algorithm.is_cap} does nothing with off_policy=cispo: CISPO's weight is its ratio "
                "clipped at 1 + algorithm.clip_high; set is_cap=null"
            )
        if algorithm.is_cap is not None and algorithm.old_logprobs == "sampler":
            raise ValueError(
                f"algorithm.is_cap={algorithm.is_cap} does nothing with algorithm.old_logprobs=sampler: the ratio is "
                "already taken against the sampling policy (its importance weight) and the clip bounds it; set "
                "is_cap=null, or old_logprobs=learner for a correction between the two"
            )
        if method not in ("tis", "cispo") and algorithm.old_logprobs == "sampler":
            raise ValueError(
                f"algorithm.off_policy={method} weights the gap between the learner's log-probs and the sampler's: "
                "it needs algorithm.old_logprobs=learner (or auto)"
            )
        if algorithm.is_floor is not None and (algorithm.is_cap is None or algorithm.is_floor >= algorithm.is_cap):
            raise ValueError(
                f"algorithm.is_floor={algorithm.is_floor} needs an is_cap above it (is_cap={algorithm.is_cap})"
            )
        return self

    @model_validator(mode="after")
    def _jail_settings_from_their_keys(self) -> Config:
        """`code_tests`'s jail takes its isolation, memory and time budget from the `reward` section alone."""
        for number, spec in enumerate(self.reward.functions):
            named = sorted(set(spec.kwargs) & set(JAIL_SETTINGS)) if spec.name in MODEL_CODE_REWARDS else []
            if named:
                raise ValueError(
                    f"reward.functions.{number}.kwargs.{named[0]}: {spec.name}'s jail takes it from "
                    f"{RESERVED_FIELDS[named[0]]}, not from its kwargs: remove it there and set that key"
                )
        return self

    @model_validator(mode="after")
    def _isolation_where_the_model_code_runs(self) -> Config:
        if self.reward.isolation == "auto":
            self.reward.isolation = "require" if self.model_code_runs else "best_effort"
        return self

    @property
    def model_code_runs(self) -> bool:
        """Whether the model's own code runs (`runs_model_code`)."""
        tools = (self.environment.tools or []) if self.environment is not None else []
        return runs_model_code([spec.name for spec in self.reward.functions] + self.judges, tools)

    @model_validator(mode="after")
    def _judge_and_reward_model_are_rewards(self) -> Config:
        for name, setting, what in (
            ("judge", self.reward.judge, "reward.judge (its model, prompt, verdict)"),
            ("reward_model", self.reward.model, "reward.model (its path)"),
        ):
            named = [spec.name for spec in self.reward.functions].count(name)
            key = what.split()[0]
            if setting is not None and named != 1:
                raise ValueError(
                    f"{key} is set: list its {'verdict' if name == 'judge' else 'score'} once in reward.functions, "
                    f"as {{name: {name}, weight: ...}}"
                )
            if setting is None and named:
                raise ValueError(f"reward.functions names `{name}`, and {what} is not set")
        if "reward_model" in self.judges:
            raise ValueError(
                "eval.reward (or an eval set's reward) is `reward_model`: an evaluation counts the answers a reward "
                "judges correct (1.0), and a reward model's score is no verdict; judge with a reward that reads the "
                "row's answer (math_answer, exact_answer, ...)"
            )
        return self

    @model_validator(mode="after")
    def _pure_distillation_samples_every_group(self) -> Config:
        distill = self.algorithm.distill
        if distill is not None and not distill.with_rewards and self.algorithm.dynamic_sampling:
            raise ValueError(
                "algorithm.dynamic_sampling drops groups whose rewards are equal, and pure distillation "
                "(algorithm.distill.with_rewards: false) trains on the teacher's judgement, not the rewards: turn "
                "dynamic_sampling off, or set algorithm.distill.with_rewards: true"
            )
        return self

    @model_validator(mode="after")
    def _images_where_a_run_can_take_them(self) -> Config:
        if self.data.images_column is None:
            return self
        refused = {
            "an environment (an episode's turns take no images)": self.environment is not None,
            "learner.packing (the learner pads a step's image rows; set learner.packing: false)": self.learner.packing,
            "learner.lora (adapters on a vision-language model are not supported yet)": self.learner.lora is not None,
            "algorithm.distill (the teacher scores the tokens without their images)": self.algorithm.distill
            is not None,
            "reward.judge or reward.model (they read the prompt's text, not its images)": self.reward.judge is not None
            or self.reward.model is not None,
            "an sft warm-up (it trains on the text alone)": self.sft is not None,
        }
        for what, given in refused.items():
            if given:
                raise ValueError(f"prompts with images (data.fields.images, or the color task) do not go with {what}")
        return self

    @model_validator(mode="after")
    def _delta_needs_broadcast(self) -> Config:
        if self.sync.delta and self.sync.transport == "object_store":
            raise ValueError(
                "sync.delta needs the broadcast transport (it patches each engine's copy in place); got "
                "sync.transport=object_store: set sync.transport to broadcast or auto, or sync.delta to false"
            )
        return self

    @model_validator(mode="after")
    def _adapters_go_whole(self) -> Config:
        if self.sync.delta and self.learner.lora is not None and self.learner.lora.serve == "adapter":
            raise ValueError(
                "sync.delta sends the changed elements of a model's weights; with learner.lora.serve=adapter a sync "
                "sends the adapter alone, whole (megabytes): set sync.delta to false, or learner.lora.serve=merged"
            )
        return self

    @model_validator(mode="after")
    def _in_flight_needs_staleness(self) -> Config:
        if self.sync.mode == "in_flight" and self.rollout.max_staleness == 0:
            raise ValueError(
                "sync.mode=in_flight needs rollout.max_staleness >= 1: at 0 nothing is generated while the learner "
                "trains, so there is no batch under way to update; set rollout.max_staleness=1 or sync.mode="
                "between_batches"
            )
        return self

    @model_validator(mode="after")
    def _overlong_buffer_fits(self) -> Config:
        algorithm = self.algorithm
        if algorithm.overlong == "soft_penalty" and not 0 < algorithm.overlong_buffer <= self.rollout.max_new_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer must be in 1..rollout.max_new_tokens ({self.rollout.max_new_tokens}) "
                f"with overlong: soft_penalty (got {algorithm.overlong_buffer})"
            )
        return self

    @model_validator(mode="after")
    def _one_object_store(self) -> Config:
        if self.checkpoint.dir and "://" in self.checkpoint.dir:
            raise ValueError(
                f"checkpoint.dir={redact(self.checkpoint.dir)!r}: an object store is set as run.output_dir "
                "(checkpoints go under it); checkpoint.dir takes a path"
            )
        if self.object_store and self.checkpoint.dir:
            raise ValueError(
                f"checkpoint.dir must be null with an object-store run.output_dir ({redact(self.run.output_dir)}): the "
                "checkpoints go there, under <name>/checkpoints"
            )
        return self

    @model_validator(mode="after")
    def _sequences_fit_a_micro_batch(self) -> Config:
        budget = self.learner.max_tokens_per_micro_batch
        if budget is not None and budget < self.sequence_budget:
            source = (
                "environment.max_total_tokens"
                if self.environment
                else "data.max_prompt_tokens + rollout.max_new_tokens"
            )
            raise ValueError(
                f"learner.max_tokens_per_micro_batch ({budget}) is below the longest sequence the learner can get "
                f"({self.sequence_budget} tokens: {source}): raise it to at least {self.sequence_budget}"
            )
        return self

    @model_validator(mode="after")
    def _trajectories_fit(self) -> Config:
        environment = self.environment
        if environment is None:
            return self
        if environment.max_total_tokens > self.rollout.max_model_len:
            raise ValueError(
                f"environment.max_total_tokens ({environment.max_total_tokens}) is above rollout.max_model_len "
                f"({self.rollout.max_model_len}), the engine's context: lower the one or raise the other"
            )
        if self.data.max_prompt_tokens >= environment.max_total_tokens:
            raise ValueError(
                f"data.max_prompt_tokens ({self.data.max_prompt_tokens}) leaves no room for a turn under "
                f"environment.max_total_tokens ({environment.max_total_tokens})"
            )
        if self.data.chat_template is False:
            raise ValueError(
                "an environment's conversations are rendered by the chat template: data.chat_template "
                "cannot be false with an environment"
            )
        if self.algorithm.overlong == "soft_penalty":
            raise ValueError(
                "algorithm.overlong=soft_penalty measures a completion against rollout.max_new_tokens, a "
                "turn's limit: with an environment use overlong: mask (cut trajectories out of the loss) "
                "or none"
            )
        longest = max(
            environment.max_turns * environment.tool_timeout_s,
            environment.episode_timeout_s if environment.agent else 0.0,
        )
        if longest >= self.faults.generate_timeout_s:
            raise ValueError(
                f"an episode may wait {longest:g} s on its tools or agent (environment.max_turns x tool_timeout_s, or "
                f"episode_timeout_s), not less than faults.generate_timeout_s ({self.faults.generate_timeout_s:g} s), "
                "after which a generator without an answer is replaced as hung: lower the one or raise the other"
            )
        return self

    @property
    def generation_budget(self) -> int:
        """The most tokens a completion samples: `rollout.max_new_tokens`; with an environment, a trajectory's
        turns together, bounded by `environment.max_total_tokens`."""
        return self.environment.max_total_tokens if self.environment else self.rollout.max_new_tokens

    @property
    def sequence_budget(self) -> int:
        """The longest sequence the learner trains on: prompt and completion, or a whole trajectory."""
        if self.environment:
            return self.environment.max_total_tokens
        return self.data.max_prompt_tokens + self.rollout.max_new_tokens

    @property
    def judges(self) -> list[str]:
        """The rewards that judge evaluation answers: `eval.reward`, then each eval set's own, each once."""
        names = [self.eval.reward] + [spec.reward for spec in self.eval.sets if spec.reward]
        return list(dict.fromkeys(names))

    @property
    def object_store(self) -> str | None:
        """The object-store URI the run's files go to (`run.output_dir`), or None when it is a path."""
        return self.run.output_dir if "://" in self.run.output_dir else None

    @property
    def run_dir(self) -> Path:
        """Where this run writes its outputs (with an object store: the staging directory on this node)."""
        return Path(self.run.staging_dir if self.object_store else self.run.output_dir) / self.run.name

    def shown(self, *parts: str) -> str:
        """Where a file of the run is, as its user finds it: under `run.output_dir` (a path, or a URI)."""
        if not self.object_store:
            return str(self.run_dir.joinpath(*parts).expanduser().absolute())
        return redact(uri_join(self.run.output_dir, self.run.name, *parts))

    @property
    def checkpoints_shown(self) -> str:
        """Where the run's checkpoints are, as its user finds them."""
        return self.shown("checkpoints") if self.object_store else str(self.checkpoint_dir)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir / "checkpoints"


MODEL_CODE_REWARDS = ("code_tests",)
"""Built-in rewards that run the model's code, each run jailed (`grpo_dist.rewards.code`)."""
MODEL_CODE_TOOLS = ("python",)
"""Built-in tools that run the model's code, each call jailed: run by the generator itself, not a tool sandbox."""
JAIL_SETTINGS = ("isolation", "memory_mb", "budget_s")
"""Those of `RESERVED_FIELDS` the reward runner passes `code_tests` from the `reward` section itself: not from a
reward's kwargs either."""


def runs_model_code(rewards: list[str], tools: list[str] = ()) -> bool:
    """Whether rewards and tools so named run the model's code (where `reward.isolation: auto` means `require`)."""
    return bool(set(rewards) & set(MODEL_CODE_REWARDS) or set(tools) & set(MODEL_CODE_TOOLS))


def refuse_credentials(value: str, key: str) -> None:
    """Raise `ConfigError` when `value`, given as `key` (a config key, a command-line flag), is a URI carrying
    credentials; the message shows it redacted, or not at all (`shown_uri`)."""
    found = uri_credentials(value)
    if found:
        raise ConfigError(
            f"{key}: {shown_uri(value)} carries credentials ({', '.join(found)}): remove them; {CREDENTIALS_GO}"
        )


def _strings(tree: Any, key: str = "") -> list[tuple[str, str]]:
    """Every string in a dumped config, by its dotted key (`eval.sets.0.path`)."""
    if isinstance(tree, dict):
        return [found for name, child in tree.items() for found in _strings(child, f"{key}.{name}".lstrip("."))]
    if isinstance(tree, list):
        return [found for index, child in enumerate(tree) for found in _strings(child, f"{key}.{index}")]
    return [(key, tree)] if isinstance(tree, str) else []


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Read a YAML config, apply `a.b.c=value` overrides and validate everything."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    for override in overrides:
        apply_override(raw, override)
    return validate_config(raw, source=str(path))


def apply_override(raw: dict, override: str) -> None:
    """Set `section.key=value` in a raw config dict; the value is parsed as YAML (`8`, `1e-5`, `null`, `[a, b]`). A
    number picks an item of a list (`reward.functions.1.weight=0.5`: the second function's weight)."""
    key, sep, text = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {redact(repr(override))} must look like section.key=value")
    named = redact(repr(override))
    node = raw
    parts = key.split(".")
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(
                    f"override {named}: {'.'.join(parts[:depth])} is a list of {len(node)} items, indexed 0 to "
                    f"{len(node) - 1}, not {part!r}"
                )
            part = int(part)
        elif not isinstance(node, dict):
            raise ConfigError(f"override {named}: {parts[depth - 1]!r} holds a value, not a section")
        if last:
            node[part] = yaml.safe_load(text) if text.strip() else None
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            node = node[part]


def validate_config(raw: dict, source: str = "<config>") -> Config:
    """Validate a raw dict into a Config; every problem is reported with its dotted key."""
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        problems = [_describe(error) for error in err.errors()]
        raise ConfigError(f"{source}: invalid config:\n  " + "\n  ".join(problems)) from None


def _describe(error: dict) -> str:
    location = [str(part) for part in error["loc"]]
    key = ".".join(location) or "<top level>"
    if error["type"] == "extra_forbidden":
        return f"{key}: unknown key{_suggestion(location)}"
    if error["type"] == "missing":
        return f"{key}: required key is missing"
    value = error.get("input")
    shown = "" if isinstance(value, dict) else f" (got {redact(repr(value))})"
    if isinstance(value, str) and SCHEME.match(value) and not URI.fullmatch(value):  # a redaction could miss a secret
        shown = f" (got {shown_uri(value)})"
    return f"{key}: {error['msg']}{shown}"


def _suggestion(location: list[str]) -> str:
    """' (did you mean X?)' for a typo in a key, from the valid keys at that level."""
    model: type[BaseModel] | None = Config
    for part in location[:-1]:
        if part.isdigit():  # an index into a list of sections, e.g. reward.functions.0
            continue
        field = model.model_fields.get(part) if model else None
        model = _section_type(field.annotation) if field else None
        if model is None:
            return ""
    close = difflib.get_close_matches(location[-1], list(model.model_fields), n=1, cutoff=0.5)
    if close:
        return f" (did you mean {'.'.join(location[:-1] + close)}?)"
    return f"; valid keys here: {', '.join(model.model_fields)}"


def _section_type(annotation: Any) -> type[BaseModel] | None:
    candidates = getattr(annotation, "__args__", (annotation,))
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None
