"""The sections of a grpo-dist config (`grpo_dist.config.Config` holds one of each): every key typed, with its
default, its constraints and a docstring (the site's configuration page is made from them). Pydantic only: no torch,
no ray."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field, model_validator


class _Section(BaseModel):
    # allow_inf_nan=False: a number that is NaN or infinite (`.inf`, `.nan`, `inf` in an override) bounds, weighs and
    # limits nothing, so every float of a config is finite; `Kwargs` holds the numbers of untyped keyword arguments
    # to the same rule.
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True, allow_inf_nan=False
    )


def _non_finite(tree: Any, key: str) -> str | None:
    """The dotted key (under `key`) of the first number in `tree` that is NaN or infinite, or None."""
    if isinstance(tree, float):
        return None if math.isfinite(tree) else key
    children = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list | tuple) else ()
    return next((found for name, child in children if (found := _non_finite(child, f"{key}.{name}"))), None)


def _finite_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` when every number in them is finite; otherwise a `ValueError` naming the first that is not."""
    found = _non_finite(kwargs, "kwargs")
    if found is not None:
        raise ValueError(f"{found} is not a finite number: every number of a config must be finite")
    return kwargs


Kwargs = Annotated[dict[str, Any], AfterValidator(_finite_kwargs)]


def _absolute(paths: list[str]) -> list[str]:
    relative = [path for path in paths if not path.startswith("/")]
    if relative:
        raise ValueError(f"{relative}: give absolute paths (the sandbox sees each at its own path)")
    return paths


SandboxPaths = Annotated[list[str], AfterValidator(_absolute)]
"""Keyword arguments a config passes on as they are (to a reward function, an environment): any values, every
number among them finite."""


def _one_path_component(name: str) -> str:
    """`run.name` when it is one plain path component: the run's directory under `run.output_dir`, never above it
    nor beside another (`.` would be the output directory itself, `../x` a directory outside it)."""
    if name in ("", ".", "..") or any(character in name for character in "/\\\0"):
        raise ValueError(
            "must be one plain path component, the name of the run's directory under run.output_dir: not empty, "
            "not '.' or '..', and without '/', '\\' or a NUL character; choose a name such as 'grpo-7b'"
        )
    return name


class RunConfig(_Section):
    name: Annotated[str, AfterValidator(_one_path_component)] = "grpo"
    """Run name: the W&B run name and the sub-directory of `output_dir` this run writes to (one plain path
    component: not empty, `.` or `..`, without `/`, `\\` or NUL)."""
    output_dir: str = "outputs"
    """Directory under which `<name>/` holds every file of the run: metrics.jsonl, checkpoints, the final policy
    and the W&B files. A path (with learner ranks on several nodes, one every node mounts at the same path) or an
    object-store URI (`s3://bucket/runs`, `gs://...`: files are written under `staging_dir` and uploaded)."""
    staging_dir: str = "/tmp/grpo-dist-staging"
    """With an object-store `output_dir`: the directory on each node's own disk (the same path on every node) where
    files are written before they are uploaded and a checkpoint is downloaded to resume from."""
    steps: int = Field(100, ge=1)
    """Number of training steps (one rollout batch, one optimizer update and one weight sync each)."""
    seed: int = 0
    """Seed for prompt order, model initialisation and sampling."""
    save_final: bool = True
    """Save the final policy in Hugging Face format to `<output_dir>/<name>/final`."""


class TinyModelConfig(_Section):
    hidden_size: int = Field(128, ge=64)
    """Hidden width; `hidden_size / num_heads` must be 64 (vLLM's CPU attention rejects smaller heads)."""
    num_layers: int = Field(2, ge=1)
    """Number of transformer blocks."""
    num_heads: int = Field(2, ge=1)
    """Attention heads per block."""
    intermediate_size: int = Field(256, ge=1)
    """MLP width."""
    characters: str | None = None
    """The tokenizer's characters, one token each; null means all of printable ASCII."""
    chat_template: bool = False
    """Give the tokenizer the built-in chat template (roles, tool turns, each turn ended by the end-of-sequence
    token): what an environment's multi-turn conversations need."""
    vision: bool = False
    """Build a vision-language model instead (Idefics3: a one-layer vision tower of 64 wide heads reading 56 x 56
    pictures as 4 image tokens each, and this text model), with its processor and a chat template that places a
    prompt's images: what a run on images (`data.fields.images`, the `color` task) needs."""

    @model_validator(mode="after")
    def _head_dim_is_64(self) -> TinyModelConfig:
        if self.hidden_size != 64 * self.num_heads:
            raise ValueError(
                f"hidden_size / num_heads must be 64 (got {self.hidden_size} / {self.num_heads}); "
                f"set hidden_size to {64 * self.num_heads}"
            )
        twice = sorted({c for c in self.characters or "" if self.characters.count(c) > 1})
        if twice or self.characters == "":
            raise ValueError(f"characters must be distinct (given more than once: {twice}) and not empty")
        return self


class ModelConfig(_Section):
    path: str
    """The initial policy, a Hugging Face causal LM (config, weights, tokenizer): a local directory, or a hub id
    (`org/name`) resolved once by the driver to a snapshot in the Hugging Face cache (HF_HOME; on a cluster, one
    every node mounts) that every rank and engine loads."""
    revision: str | None = None
    """With a hub id: the branch, tag or commit to load; null: main."""
    tiny: TinyModelConfig | None = None
    """Build a random-init tiny model with a character tokenizer at `path` (at `sft.base` when the config has a
    warm-up) when it does not exist yet."""


class TaskConfig(_Section):
    name: Literal["last_digit", "add", "add_multi", "multiply", "color"] = "last_digit"
    """Bundled synthetic task: `last_digit` (answer the prompt's last digit), `add` (single-digit sums),
    `add_multi` (sums of two numbers below 100), `multiply` (products of 2-digit numbers, with tool-use
    transcripts for an environment with the `calculator`) or `color` (the digit naming the color of a picture's
    disc: 1 red, 2 green, 3 blue; a vision-language model's task, its pictures in the rows' `images`)."""
    num_train: int = Field(2000, ge=1)
    """Training prompts to generate."""
    num_eval: int = Field(200, ge=1)
    """Held-out prompts to generate."""


class FieldsConfig(_Section):
    prompt: str = "prompt"
    """Column holding the prompt text (a dotted path such as `question.text` reaches into a nested column)."""
    answer: str | None = "answer"
    """Column holding the reference answer, passed to the rewards as `answer` (a dotted path such as
    `reward_model.ground_truth` reaches into a nested column); null when the rewards need none."""
    messages: str | None = None
    """Column holding the prompt as chat turns (`[{role, content}, ...]`), used instead of `prompt`."""
    images: str | None = None
    """Column holding a row's images (a list of them, or one): paths (relative to the dataset file's folder) or
    `file://` URLs, image bytes, or a `datasets` Image column. Each is placed before the prompt's text in its first
    user turn, as the model's chat template and processor place an image; the model must be a vision-language model.
    null: text prompts (a column named `images` then reaches the rewards like any other)."""


class DataConfig(_Section):
    path: str | None = None
    """Training prompts: a JSONL, Parquet or CSV file, a `datasets` `save_to_disk` directory, or a hub dataset id
    (`org/name`, read through `datasets` from the Hugging Face cache or the hub)."""
    split: str = "train"
    """The split of `path` to train on (a `save_to_disk` directory of several splits, or a hub dataset)."""
    subset: str | None = None
    """The subset (configuration) of a hub dataset, e.g. `main` for openai/gsm8k."""
    eval_path: str | None = None
    """Held-out prompts, in any layout `path` takes; accuracy on them is printed before and after training."""
    eval_split: str = "test"
    """The split of `eval_path` (a `save_to_disk` directory of several splits, or a hub dataset)."""
    task: TaskConfig | None = None
    """Generate a bundled synthetic task into the run directory instead of reading `path`/`eval_path`."""
    fields: FieldsConfig = Field(default_factory=FieldsConfig)
    """Which columns hold the prompt (or its chat turns) and the answer; the other columns reach the rewards too."""
    system_prompt: str | None = None
    """A system turn put before every prompt (as the chat template renders it; a paragraph of its own in raw text)."""
    chat_template: bool | None = None
    """true: render prompts with the tokenizer's chat template (it must have one); false: raw text; null: the
    template when the tokenizer has one."""
    max_prompt_tokens: int = Field(256, ge=1)
    """Prompts longer than this (after the chat template) are skipped and counted."""
    prompts_per_step: int = Field(16, ge=1)
    """Prompts per rollout batch; each yields `rollout.group_size` completions."""

    @property
    def images_column(self) -> str | None:
        """The column of a row's images: `fields.images`, or the `color` task's `images`; None for text prompts."""
        if self.task is not None:
            return "images" if self.task.name == "color" else None
        return self.fields.images

    @model_validator(mode="after")
    def _has_a_source(self) -> DataConfig:
        if self.task is None and self.path is None:
            raise ValueError("set either data.path (a file, a directory, a hub dataset) or data.task (a bundled task)")
        if self.task is not None and self.path is not None:
            raise ValueError("set only one of data.path and data.task")
        if self.task is not None and self.task.name != "color" and self.fields.images is not None:
            raise ValueError(
                f"data.fields.images names a column of data.path, and the {self.task.name} task's rows have no images"
                " (the color task's do): set it to null, or train on data.path"
            )
        if self.images_column is not None and self.chat_template is False:
            raise ValueError(
                "data.fields.images: a prompt's images are placed by the model's chat template, which"
                " data.chat_template: false turns off; set it to true or null"
            )
        if self.fields.messages is not None and self.chat_template is False:
            raise ValueError(
                "data.fields.messages holds chat turns, which only a chat template renders: set data.chat_template to "
                "true or null, or map a text column with data.fields.prompt"
            )
        return self


class AutoscaleConfig(_Section):
    """Generators that follow the bottleneck: after each step, the share of the step the learner waited on
    generation is set against the share the generators waited on the learner; when one exceeds the other by `band`
    for `patience` steps in a row, a generator is added (the learner waits) or removed (the generators wait),
    within [`min`, `max`]. A change is asked for like `grpo-dist scale` (a new generator joins once placed and
    started; Ray's autoscaler is asked for the resources) and the count is held while one is joining."""

    min: int = Field(1, ge=1)
    """The fewest generators."""
    max: int = Field(ge=1)
    """The most generators."""
    band: float = Field(0.2, gt=0, lt=1)
    """How far apart the two waiting shares must be (as shares of the step) to call for a change."""
    patience: int = Field(2, ge=1)
    """Steps in a row the same change must be called for (and steps after a change before the next)."""

    @model_validator(mode="after")
    def _min_under_max(self) -> AutoscaleConfig:
        if self.min > self.max:
            raise ValueError(f"rollout.autoscale.min ({self.min}) is above rollout.autoscale.max ({self.max})")
        return self


class RolloutConfig(_Section):
    num_generators: int = Field(1, ge=1)
    """Generator actors, each running one vLLM engine; prompts of a batch are split between them (with `autoscale`,
    the count the run starts with)."""
    autoscale: AutoscaleConfig | None = None
    """Add and remove generators as the step's timing says (`min`, `max`, ...); null: `num_generators` throughout,
    unless `grpo-dist scale` changes it."""
    group_size: int = Field(8, ge=2)
    """G: completions sampled per prompt; advantages are computed within each group."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest completion, in tokens."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (the learner scores tokens at the same temperature)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    max_model_len: int = Field(512, ge=8)
    """vLLM context length: prompt plus completion."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine dtype. auto: float32 on CPU (generator and learner logprobs equal to float tolerance), the model's own
    dtype on a GPU (bfloat16 for a float32 checkpoint); float32 on a GPU takes twice the memory."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Share of each GPU vLLM may take (ignored on CPU)."""
    kv_cache_gb: float | None = Field(None, gt=0)
    """On GPUs, each engine's KV cache pinned at this many GB per GPU (vLLM's `kv_cache_memory_bytes`), so that
    what fits does not move with vLLM's own estimate of its activations, which changes between vLLM versions;
    `grpo-dist plan` checks it against the budget and gives the tokens it holds. null: vLLM sizes it at start from
    `gpu_memory_utilization` (the plan says so)."""
    enforce_eager: bool | None = None
    """Run the engine eagerly (no CUDA graphs). null: eager on CPU, CUDA graphs on a GPU; true trades speed for
    start-up time and memory."""
    cpu_kv_cache_gib: float = Field(0.25, gt=0)
    """KV-cache size per engine on the CPU backend, in GiB (on a GPU `gpu_memory_utilization` sizes it)."""
    num_cpus: float = Field(1.0, gt=0)
    """CPUs reserved per generator actor."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs per generator actor (0 on a CPU machine); with `tensor_parallel_size` > 1, per engine worker (1)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one engine spans with tensor parallelism (vLLM's Ray executor, all on one node). Needs GPUs: vLLM's
    CPU backend here runs one worker per engine."""
    max_staleness: int = Field(0, ge=0)
    """k: every completion trained on was sampled by weights at most k updates older than the learner's. 0 is
    on-policy (generate, score, train, sync in turn); with k >= 1 the next batch is generated and scored while the
    learner trains, and weights are synced only as often as the bound needs."""

    @model_validator(mode="after")
    def _starts_within_autoscale(self) -> RolloutConfig:
        scale = self.autoscale
        if scale is not None and not scale.min <= self.num_generators <= scale.max:
            raise ValueError(
                f"rollout.num_generators ({self.num_generators}) is outside rollout.autoscale's [{scale.min}, "
                f"{scale.max}]: the run starts with num_generators"
            )
        return self

    @model_validator(mode="after")
    def _tensor_parallel_needs_gpus(self) -> RolloutConfig:
        if self.tensor_parallel_size > 1 and self.num_gpus != 1:
            raise ValueError(
                f"rollout.tensor_parallel_size={self.tensor_parallel_size} needs rollout.num_gpus=1 (one GPU per "
                f"engine worker; got {self.num_gpus}); on a CPU machine keep tensor_parallel_size at 1 and add "
                "generators with rollout.num_generators instead"
            )
        return self


class RewardFunctionConfig(_Section):
    name: str
    """A built-in reward (`math_answer`, `exact_answer`, `number_format`, `boxed_format`, `regex_format`,
    `code_tests`, `environment`, `tool_use`), `judge` (the verdict of `reward.judge`), `reward_model` (the score of
    `reward.model`), or the dotted path of a user function `(prompt, completion, **fields) -> float`."""
    weight: float = 1.0
    """Weight of this function in the combined reward."""
    floor: float = 0.0
    """The score of a call the completion made fail (it ran past `reward.timeout_s`, raised, ran out of memory or
    ended its sandbox), under `reward.on_failure: floor`: this function's lowest score, so that breaking the grader
    never pays better than a wrong answer. Every built-in scores from 0 up (`environment`: what the environment
    gave); set a user function's lowest score here when it can go below 0."""
    kwargs: Kwargs = Field(default_factory=dict)
    """Extra keyword arguments passed on every call; they win over a row's field of the same name. `code_tests`
    takes `timeout_per_test_s` here; its jail's other settings come from `reward.isolation`,
    `reward.sandbox_memory_mb` and `reward.timeout_s`."""


class JudgeConfig(_Section):
    model: str
    """The judge: a Hugging Face causal LM (a local directory or a hub id), frozen, served by vLLM engines of its
    own. Its verdict is the reward function `judge` (list it in `reward.functions`, with its weight)."""
    prompt: str = "Question: {prompt}\nAnswer: {completion}\nReference: {answer}\nScore the answer from 0 to 10."
    """What the judge reads, as a user message through its chat template (raw when it has none): `{prompt}`,
    `{completion}` (a trajectory's last turn) and any field of the row (`{answer}`) are filled in."""
    verdict: str = r"(-?[0-9]+(?:\.[0-9]+)?)"
    """A regular expression whose first group, in the judge's reply, is its score (the first match)."""
    scale: float = Field(10.0, gt=0)
    """The score is divided by this (a 0-10 verdict becomes 0-1). A reply with no match is unscored."""
    min_score: float = 0.0
    """The lowest score, after the division by `scale`: a verdict below it (`Score: -5`) counts as it, and is
    counted in `judge/clamped`."""
    max_score: float = 1.0
    """The highest score, after the division by `scale` (1.0: a 10 on the default prompt's 0-10 scale): a verdict
    above it (`Score: 1000000`) counts as it, and is counted in `judge/clamped`."""
    max_tokens: int = Field(64, ge=1)
    """Longest judge reply; it is decoded greedily."""
    max_model_len: int = Field(2048, ge=8)
    """The judge engine's context."""
    num_engines: int = Field(1, ge=1)
    """Judge engines; a step's completions are split between them."""
    num_cpus: float = Field(1.0, gt=0)
    """CPUs per judge engine."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs per judge engine (0 on a CPU machine)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Judge engine dtype."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Share of each GPU a judge engine may take."""
    cpu_kv_cache_gib: float = Field(0.25, gt=0)
    """KV-cache size per judge engine on the CPU backend, in GiB."""
    max_restarts: int = Field(3, ge=0)
    """Judge engines that die may be replaced this many times in a run (each is counted in `faults/judge_restarts`);
    a batch a lost engine held is judged again once, then left unscored."""

    @model_validator(mode="after")
    def _verdict_has_a_group(self) -> JudgeConfig:
        import re

        try:
            groups = re.compile(self.verdict).groups
        except re.error as error:
            raise ValueError(f"verdict {self.verdict!r} is not a regular expression: {error}") from None
        if groups < 1:
            raise ValueError(f"verdict {self.verdict!r} has no group: put the score in parentheses, e.g. ([0-9]+)")
        return self

    @model_validator(mode="after")
    def _score_range_is_a_range(self) -> JudgeConfig:
        if self.min_score >= self.max_score:
            raise ValueError(
                f"min_score ({self.min_score}) is not below max_score ({self.max_score}): the judge's scores are "
                "clamped to [min_score, max_score]; give a lower min_score or a higher max_score"
            )
        return self


class RewardModelConfig(_Section):
    path: str
    """The reward model: a Hugging Face sequence-classification model (`AutoModelForSequenceClassification`: a
    local directory or a hub id), frozen, run by actors of its own. Its score is the reward function
    `reward_model` (list it in `reward.functions`, with its weight)."""
    revision: str | None = None
    """The hub revision (a branch, tag or commit) of a hub id; null: main."""
    label: int = Field(0, ge=0)
    """Which of the model's output logits is the score (a one-label reward model has only 0)."""
    normalize: Literal["none", "sigmoid"] = "none"
    """What the logit becomes: itself (`none`), or its sigmoid, in (0, 1) (`sigmoid`: a preference model's
    probability that the completion is the good one)."""
    scale: float = 1.0
    """The score is multiplied by this after `normalize`."""
    max_length: int | None = Field(None, ge=8)
    """Longest input the model reads, in its own tokens (null: the model's positions, `max_position_embeddings`;
    2048 where its config gives none): a longer one keeps its start and its last tokens (the end of the
    completion), its middle left out, and is counted in `reward_model/truncated`."""
    batch_size: int = Field(16, ge=1)
    """Completions per forward pass."""
    num_workers: int = Field(1, ge=1)
    """Reward-model actors; a step's completions are split between them."""
    num_cpus: float = Field(1.0, gt=0)
    """CPUs per reward-model actor."""
    num_gpus: float = Field(0.0, ge=0, le=1)
    """GPUs per reward-model actor, at most one (the model is not sharded: it runs whole on its GPU); 0 on a CPU
    machine: the model runs on the CPU, in float32."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The model's dtype on a GPU (auto: bfloat16); on a CPU always float32."""
    max_restarts: int = Field(3, ge=0)
    """Reward-model actors that die may be replaced this many times in a run (each is counted in
    `faults/reward_model_restarts`); a share a lost actor held is scored again once, then left unscored."""

    def length(self, positions: int | None) -> int:
        """The longest input read (`max_length`) for a model of `positions` positions (None: not given)."""
        return self.max_length or positions or 2048


class RewardConfig(_Section):
    functions: list[RewardFunctionConfig] = Field(min_length=1)
    """Reward functions, combined by weighted sum."""
    judge: JudgeConfig | None = None
    """An LLM judge: the reward function `judge` is its verdict on each completion. null: none."""
    model: RewardModelConfig | None = None
    """A reward model (a sequence classifier): the reward function `reward_model` is its score of each completion,
    read through its own tokenizer and chat template. null: none."""
    combine: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """Weighted-sum the rewards then compute advantages, or compute each function's advantages then weighted-sum
    them (one reward's scale cannot drown another's)."""
    num_workers: int = Field(2, ge=1)
    """Reward worker actors scoring completions in parallel."""
    timeout_s: float = Field(10.0, gt=0)
    """A call running longer fails (see `on_failure`); in the sandbox it is also the call's CPU time limit, and the
    sandbox is killed with everything it started."""
    on_failure: Literal["floor", "unscored"] = "floor"
    """A call the completion made fail (it ran past `timeout_s`, raised, ran out of memory, ended its sandbox):
    `floor` scores it its function's `floor`, as a wrong answer is scored; `unscored` leaves the completion unscored
    (advantage 0, out of its group's statistics), which pays a completion for breaking its grader. A failure of the
    machine (a reward worker lost, the sandbox killed from outside or not starting, a process or the network refused
    by a setting, `Unscorable` raised) leaves it unscored either way. Counted in `reward_failures/why/<kind>`."""
    sandbox: bool = True
    """Run the reward functions (and `eval.reward`) in a sandbox process of each reward worker, never in the driver
    or the worker itself: no network, limited memory and CPU time, no processes or threads, killed on its bound."""
    sandbox_memory_mb: int = Field(4096, ge=256)
    """Address space of the reward sandbox; a reward asking for more gets a MemoryError (a failure: `on_failure`)."""
    sandbox_processes: bool = False
    """Let reward code start processes and threads (killed with the sandbox when a call runs past its bound)."""
    sandbox_network: bool = False
    """Let reward code use the network (a remote judge); off, the sandbox has a network namespace of its own."""
    sandbox_env: list[str] = []
    """Names of environment variables passed on to the reward and tool sandboxes (a remote judge's API key); the
    sandboxes get no other variable of the run's environment."""
    sandbox_paths: SandboxPaths = []
    """Absolute paths of directories the reward sandbox sees too, at the same path (data a reward reads, a directory
    it writes where `nobody` may): besides them it sees only the Python install, its import path read-only and a
    private /tmp (docs/sandbox.md)."""
    isolation: Literal["auto", "require", "best_effort"] = "auto"
    """How model-written code (the `code_tests` reward, the `python` tool) is isolated. `require`: each run in
    namespaces of its own (bubblewrap), and the reward and tool sandboxes in a network namespace and, under root,
    as `nobody`; where the machine refuses any of it the run stops before any engine starts, saying what was
    refused. `best_effort`: what the machine allows, said once on the console. `auto`: `require` where the model's
    code runs, else `best_effort`. See docs/sandbox.md."""
    num_cpus: float = Field(0.25, gt=0)
    """CPUs reserved per reward worker."""
    max_unscored_fraction: float = Field(0.9, gt=0, le=1)
    """A run stops, printing each failing function's first error, when more than this fraction of a step's
    completions is unscored for `max_unscored_steps` steps in a row (training on nothing is not training); a
    function scoring its floor on more than this fraction is said once (more likely broken than broken by them)."""
    max_unscored_steps: int = Field(3, ge=1)
    """Consecutive steps over `max_unscored_fraction` that stop a run."""


class DistillConfig(_Section):
    teacher: str
    """The teacher: a Hugging Face causal LM (a local directory or a hub id) with the student's tokenizer, frozen,
    served by vLLM engines of its own. It scores every token the student sampled."""
    revision: str | None = None
    """The teacher's hub revision (a branch, tag or commit); null: the default branch."""
    coef: float = Field(1.0, gt=0)
    """Weight of the distillation advantage of each sampled token: coef x (teacher - student log-prob)."""
    with_rewards: bool = False
    """false: pure distillation, the per-token advantages alone (rewards are still scored and logged). true: the
    per-token advantages added to the group-relative advantages of the rewards."""
    baseline: Literal["group", "none"] = "group"
    """`group`: from each token's advantage, subtract the mean of its group's other completions' at the same
    position (leave-one-out; lowers the variance, not the expectation). `none`: coef x (teacher - student) as it
    is."""
    num_engines: int = Field(1, ge=1)
    """Teacher engines; a step's completions are split between them."""
    num_cpus: float = Field(1.0, gt=0)
    """CPUs per teacher engine."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs per teacher engine (0 on a CPU machine); with tensor parallelism, per GPU worker of the engine."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs each teacher engine spans."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Teacher engine dtype."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Share of each GPU a teacher engine may take."""
    cpu_kv_cache_gib: float = Field(0.25, gt=0)
    """KV-cache size per teacher engine on the CPU backend, in GiB."""
    max_restarts: int = Field(3, ge=0)
    """Teacher engines that die may be replaced this many times in a run (each is counted in
    `faults/teacher_restarts`); a batch a lost engine held is scored again once on a new one, then its completions
    get no distillation advantage (`distill/unscored`)."""

    @model_validator(mode="after")
    def _tensor_parallel_needs_gpus(self) -> DistillConfig:
        if self.tensor_parallel_size > 1 and self.num_gpus != 1:
            raise ValueError(
                f"algorithm.distill.tensor_parallel_size={self.tensor_parallel_size} needs "
                f"algorithm.distill.num_gpus=1 (one GPU per engine worker; got {self.num_gpus})"
            )
        return self


def engine_rollout(
    engines: JudgeConfig | DistillConfig, max_new_tokens: int, max_model_len: int, tensor_parallel_size: int = 1
) -> RolloutConfig:
    """The rollout settings a judge or teacher engine (a generator actor of that model) is built with, from its
    section's engine fields."""
    return RolloutConfig(
        num_generators=engines.num_engines,
        max_new_tokens=max_new_tokens,
        max_model_len=max_model_len,
        dtype=engines.dtype,
        gpu_memory_utilization=engines.gpu_memory_utilization,
        cpu_kv_cache_gib=engines.cpu_kv_cache_gib,
        num_cpus=engines.num_cpus,
        num_gpus=engines.num_gpus,
        tensor_parallel_size=tensor_parallel_size,
    )


OFF_POLICY_BOUNDS: dict[str, tuple[float | None, float]] = {
    "tis": (None, 2.0),
    "mis": (None, 2.0),
    "icepop": (0.5, 5.0),
    "seq_tis": (None, 2.0),
    "seq_mis": (None, 2.0),
}
"""(is_floor, is_cap) of each weighting correction of `AlgorithmConfig.off_policy` when left `auto`: TIS's cap 2 as
in its source, IcePop's band [0.5, 5] as in its."""


class AlgorithmConfig(_Section):
    estimator: Literal["grpo", "dr_grpo", "rloo", "batch_std", "reinforce_pp"] = "grpo"
    """Advantage estimator (see `grpo_dist.algo.group_advantages`)."""
    std: Literal["sample", "population"] = "sample"
    """Group std used by `grpo`: unbiased sample std (DeepSeekMath, TRL) or population std."""
    eps: float = Field(1e-6, gt=0)
    """Added to the std before dividing."""
    clip_low: float = Field(0.2, ge=0)
    """Lower clip range of the ratio: 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0)
    """Upper clip range of the ratio: 1 + clip_high (DAPO's clip-higher sets it above clip_low)."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip bound c > 1 on the loss of negative-advantage tokens; null disables it."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token (PPO, GRPO) or per sequence (GSPO)."""
    aggregation: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    """How per-token losses become one number (GRPO, DAPO, Dr. GRPO)."""
    kl_coef: float = Field(0.04, ge=0)
    """beta: weight of the KL penalty to the frozen reference; 0 never loads the reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator; k3 = exp(ref - lp) - (ref - lp) - 1 as in DeepSeekMath."""
    old_logprobs: Literal["auto", "learner", "sampler"] = "auto"
    """The policy the ratio is taken against, whose neighbourhood the clip keeps each step in: `learner`, the
    learner's weights before the step; `sampler`, the weights that sampled each token (the generators' sampling
    logprobs), so the ratio is itself the importance weight of an older sample. auto: `sampler` with `rollout.top_p` 1
    and no number for `is_cap`, for `off_policy: tis` with `rollout.max_staleness` >= 1 and for `cispo` at any;
    `learner` otherwise."""
    off_policy: Literal["tis", "mis", "icepop", "seq_tis", "seq_mis", "cispo"] = "tis"
    """The correction between the policy that sampled a token and the learner's (`grpo_dist.algo.off_policy`;
    docs/algorithms.md): with `old_logprobs: learner`, each token's loss weighted by k = pi_old / pi_sampler
    truncated at `is_cap` (`tis`), or set to 0 outside [`is_floor`, `is_cap`] (`mis`; `icepop`, the band [0.5,
    5] by default), or by the sequence's geometric-mean k truncated or masked (`seq_tis`, `seq_mis`); `cispo`
    replaces the clipped surrogate by CISPO's, each token's gradient weighted by its ratio to the sampling policy
    clipped at 1 + `clip_high`."""
    is_cap: float | Literal["auto"] | None = "auto"
    """The upper bound of the correction's weight: truncated there (`tis`, `seq_tis`) or masked above it (`mis`,
    `icepop`, `seq_mis`); null disables the correction. auto: 2 (`icepop` 5) with `old_logprobs: learner`, for `tis`
    only with `rollout.max_staleness` >= 1; off with `old_logprobs: sampler` (the ratio is then the importance
    weight, bounded by the clip) and for `cispo` (whose bound is `clip_high`)."""
    is_floor: float | Literal["auto"] | None = "auto"
    """The lower bound of a masking correction (`mis`, `icepop`, `seq_mis`): tokens (sequences) whose weight falls
    below it are masked too; null: none. auto: 0.5 for `icepop`, none otherwise."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus weight (the token entropy is logged every step either way)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts until the batch holds
    `data.prompts_per_step` groups."""
    max_sampling_rounds: int = Field(4, ge=1)
    """Cap on the prompts a step sends with dynamic sampling, in batches of `data.prompts_per_step`; past it the step
    trains on the groups it has."""
    overlong: Literal["none", "mask", "soft_penalty"] = "none"
    """Completions cut at `rollout.max_new_tokens`: kept as they are, masked out of the loss, or given DAPO's soft
    overlong penalty."""
    overlong_buffer: int = Field(0, ge=0)
    """Soft penalty: the last this-many tokens before `rollout.max_new_tokens` are penalised linearly."""
    overlong_penalty: float = Field(1.0, ge=0)
    """Soft penalty: reward subtracted at (and beyond) `rollout.max_new_tokens`."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each rollout batch."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer updates per pass: the rollout batch is cut into this many mini-batches."""
    distill: DistillConfig | None = None
    """On-policy distillation: a teacher scores every token the student sampled, and each token's advantage is
    pulled toward the teacher by the per-token reverse KL (alone, or with the rewards' advantages). null: none."""

    @model_validator(mode="after")
    def _is_cap_positive(self) -> AlgorithmConfig:
        if isinstance(self.is_cap, float) and not self.is_cap > 0:
            raise ValueError(f"is_cap must be > 0, auto or null (got {self.is_cap})")
        if isinstance(self.is_floor, float) and not self.is_floor >= 0:
            raise ValueError(f"is_floor must be >= 0, auto or null (got {self.is_floor})")
        if isinstance(self.is_floor, float) and self.off_policy not in ("mis", "icepop", "seq_mis"):
            raise ValueError(
                f"is_floor={self.is_floor} does nothing with off_policy={self.off_policy}: only the masking "
                "corrections (mis, icepop, seq_mis) have a lower bound"
            )
        if self.off_policy == "cispo" and (self.dual_clip is not None or self.ratio_level != "token"):
            raise ValueError(
                "off_policy=cispo clips a per-token weight in place of the clipped surrogate: it takes no dual_clip "
                "and ratio_level token"
            )
        return self


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks a vLLM engine can be built for (`max_lora_rank`)."""


class LoraConfig(_Section):
    rank: int = Field(16, ge=1)
    """The adapter's rank r: each adapted weight W [out, in] trains B [out, r] and A [r, in] instead."""
    alpha: float = Field(32.0, gt=0)
    """The adapter's scale is alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training. Above 0 a resumed run is no longer bit for bit the
    uninterrupted one (the dropout masks are not in the checkpoint)."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
    )
    """The linear layers that get an adapter, by the last part of their name (the defaults: attention and MLP of
    Llama, Qwen and kin)."""
    serve: Literal["adapter", "merged"] = "adapter"
    """How the engines serve the policy. `adapter`: the base loaded once, the adapter itself served through vLLM's
    LoRA support; a sync sends only the adapter's weights, and each engine keeps the `rollout.max_staleness` + 1
    newest versions loaded, so a request finishes under the version it started with. `merged`: each sync sends
    `W + B A * alpha / rank` under the base's names, which the engines serve at the base's speed, through
    `sync.transport`."""

    @property
    def slot_rank(self) -> int:
        """The rank of the engines' LoRA slots that serve this adapter: the smallest vLLM builds that holds it."""
        return next(size for size in VLLM_LORA_RANKS if size >= self.rank)

    @model_validator(mode="after")
    def _servable(self) -> LoraConfig:
        if self.serve == "adapter" and self.rank > 512:
            raise ValueError(
                f"learner.lora.rank={self.rank}: vLLM serves adapters of rank 512 at most; lower it or set "
                "learner.lora.serve=merged"
            )
        if self.serve == "adapter" and "lm_head" in self.target_modules:
            raise ValueError(
                "learner.lora.target_modules names lm_head: vLLM serves adapters on a block's linear layers, not on "
                "the output layer; leave it out or set learner.lora.serve=merged"
            )
        return self


class LearnerConfig(_Section):
    num_ranks: int = Field(1, ge=1)
    """Data-parallel learner ranks (one Ray actor each, one GPU or one CPU slot each) forming one DeepSpeed
    engine; the batch is split across them by token count."""
    placement: Literal["pack", "spread"] = "pack"
    """Learner ranks packed onto as few nodes as possible, or spread one per node where they can be."""
    lr: float = Field(1e-6, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up, in optimizer steps."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradients are clipped to this global norm."""
    micro_batch_size: int = Field(32, ge=1)
    """Sequences per forward/backward pass (without `max_tokens_per_micro_batch`); the batch is accumulated over
    micro-batches."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """Micro-batches by a token budget instead of a sequence count: each rank's rows of a mini-batch go into
    micro-batches of at most this many tokens (prompt and completion; longest first, each into the first that has
    room). It must hold the longest sequence the learner can get. null: `micro_batch_size` sequences each."""
    packing: bool = True
    """Pack each micro-batch's sequences into one row without padding (each keeps its own positions; attention
    never crosses between them) and compute logits only where the next token counts in the loss; on a CPU, a
    group's rows in one micro-batch hold their shared prompt once (the same scores from fewer tokens; not for a
    model with recurrent layers). false: pad every sequence of a micro-batch to its longest and compute logits at
    every position."""
    zero_stage: Literal[0, 1, 2, 3] = 0
    """DeepSpeed ZeRO stage: 1 shards the optimizer state over the ranks, 2 also the gradients, 3 also the
    parameters (and the reference model)."""
    offload: Literal["none", "optimizer", "optimizer_and_params"] = "none"
    """DeepSpeed CPU offload: the optimizer state (ZeRO >= 1), or it and the parameters (ZeRO-3)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, about a third more compute)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Training precision: auto is bf16 (fp32 master weights) with a GPU and fp32 without."""
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend: auto picks nccl with a GPU and gloo without."""
    num_cpus: float = Field(1.0, gt=0)
    """CPUs reserved per learner rank."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs per learner rank (1 on a GPU cluster, 0 on a CPU machine)."""
    threads: int | None = Field(None, ge=1)
    """torch threads per learner rank. null: with a GPU, `num_cpus`; without, the node's cores shared among the
    learner ranks on it (training and generation take turns, so training may use the whole machine) and among the
    runs sharing the machine, where `GRPO_DIST_CPU_SHARE` in the environment says how many."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter instead of every weight (`grpo_dist.models.lora`): the base model frozen, the optimizer
    holding the adapter alone, the KL's reference the base with the adapter off (no second copy). The engines get
    the merged policy. null: full fine-tuning."""

    @model_validator(mode="after")
    def _offload_fits_the_stage(self) -> LearnerConfig:
        needed = {"none": 0, "optimizer": 1, "optimizer_and_params": 3}[self.offload]
        if self.zero_stage < needed:
            raise ValueError(
                f"learner.offload={self.offload} needs learner.zero_stage >= {needed} (got {self.zero_stage})"
            )
        return self


class SyncConfig(_Section):
    transport: Literal["auto", "broadcast", "object_store"] = "auto"
    """How new weights reach the generators: `broadcast` streams them in buckets from learner rank 0 over one
    process group with every engine worker (NCCL on GPUs, gloo on CPUs); `object_store` ships the full state dict
    through Ray's object store; `auto` picks broadcast where the installed vLLM has weight transfer."""
    bucket_mb: float = Field(16.0, gt=0)
    """Broadcast bucket size in MiB. Over gloo a bucket holds whole decoder layers (a larger layer is a bucket of
    its own) and each side holds two at a time: smaller buckets overlap the wire and the engine's load more
    finely."""
    timeout_s: float = Field(600.0, gt=0)
    """A weight sync (or the transport's set-up) running longer fails with an error naming the transport."""
    delta: bool = False
    """Delta sync (broadcast only): send only the weights' elements that changed since the engines' copy (compared
    at `rollout.dtype`, where bf16/fp16 leave most unchanged after a step; at the learner's dtype when it is auto),
    checked by a checksum of each engine's copy (a mismatch is synced again in full at once). Holds one more copy
    of the weights at the engines' dtype in learner rank 0's host memory, and travels over gloo (TCP) even on
    GPUs."""
    full_every: int = Field(20, ge=1)
    """With `delta`: every this many syncs one sends every weight, whatever changed."""
    mode: Literal["between_batches", "in_flight"] = "between_batches"
    """When the generators take new weights, with `rollout.max_staleness` >= 1: `between_batches` once the batch
    being generated is done; `in_flight` as soon as the learner's step ends, mid-batch (each engine pauses with its
    requests kept, loads the weights and resumes; a completion may then span versions, and its oldest counts)."""
    probe: bool = True
    """After every sync, check that each engine serves what was sent: its log-probabilities of a fixed probe
    sequence (the first training prompts' tokens, up to 64) against the learner's, the mean absolute difference
    per token logged as `sync/probe_gap` (the largest over engines). A gap above `probe_max_gap`, and above a tenth
    of how far the learner's own log-probabilities of the probe moved since the engines' last checked version (a
    diverging policy's large logits widen the numerical gap too; an engine that missed the update is as far as the
    update moved), is a fault: every weight is sent again, and if the gap stays the run stops, naming the engine."""
    probe_max_gap: float | None = Field(None, gt=0)
    """The largest gap a sync may leave. None: 1e-3 where the learner and the engines both compute in float32 (a
    healthy sync leaves about 2e-7 on a CPU), 0.1 where either uses bf16 or fp16 (where the two sides' rounding
    differs)."""


class StepFactor(_Section):
    step: int = Field(ge=1)
    """The training step."""
    factor: float = Field(allow_inf_nan=True)
    """What it is multiplied by: `.nan` poisons a loss, `1e6` makes its gradient spike, `300` a learning rate."""
    once: bool = False
    """Only the first time the step is trained (a step trained again after a rollback is then healthy; a restarted
    learner group starts afresh)."""


class DroppedVersion(_Section):
    version: int = Field(ge=1)
    """The weight version (the learner's step that made it) the engines load and then drop."""
    once: bool = False
    """Only the first time the version arrives (a sync that sends it again is then taken)."""


class SlowStep(_Section):
    step: int = Field(ge=1)
    """The training step."""
    seconds: float = Field(gt=0)
    """How long each of its micro-batches is held after its backward pass."""


class InjectConfig(_Section):
    """Faults injected on purpose, to rehearse what a run does about them on this cluster: its guard, its checks,
    its bounds and its recovery (`grpo_dist.faults.inject`). Nothing is injected unless listed here, and a run that
    injects anything says so when it starts."""

    scale_loss: list[StepFactor] = []
    """Training steps whose loss the learner ranks multiply by `factor`."""
    scale_lr: list[StepFactor] = []
    """Training steps whose learning rate the learner ranks multiply by `factor` (for that step's updates only)."""
    drop_weights: list[DroppedVersion] = []
    """Weight versions the generators load and then replace with the initial model's weights, still labelled with
    the new version: an engine that silently serves other weights than it was sent (serving adapters: one that
    dropped its adapter)."""
    slow_training: SlowStep | None = None
    """A training step whose every micro-batch the learner ranks hold back, as a machine shared with other work
    would slow them."""
    fail_allocation_at_step: int | None = Field(None, ge=1)
    """A training step in which the learner ranks ask for more memory than any machine has, every time it is
    trained: a real allocation failure inside a real step."""
    slow_generation_file: str | None = None
    """A file holding a number of seconds: each generator holds each sampled group back that long, one group at a
    time, as a slower engine would. Read at every group, so changing the file changes the generators' speed while
    the run goes; none, 0 or no file: no delay."""


class FaultsConfig(_Section):
    start_timeout_s: float = Field(600.0, gt=0)
    """An actor (learner rank, generator, reward worker) that has not started (placed, its model loaded) within
    this many seconds stops the run, naming it."""
    generate_timeout_s: float = Field(600.0, gt=0)
    """A generator that answers none of its calls (a few prompts' groups each: its share of a batch goes in about
    four) for this long while it has some under way is treated as hung: killed, replaced and its prompts generated
    again. A long queue in a working engine does not count, as long as it keeps answering."""
    score_timeout_s: float = Field(60.0, gt=0)
    """A reward worker that finishes no completion of its share for this long (a call stuck holding the
    interpreter) is treated as hung: killed, replaced and its completions scored again. A large share takes as long
    as it needs while its completions keep being scored."""
    train_timeout_s: float = Field(600.0, gt=0)
    """A learner rank that finishes no micro-batch (forward and backward pass) and no optimizer step for this long
    is treated as hung, and the learner group restarted from the latest checkpoint. A long step goes on as long as
    its micro-batches keep finishing, so this bound scales with the step's tokens."""
    checkpoint_timeout_s: float = Field(1800.0, gt=0)
    """The longest the learner may take to write, upload, download or load a checkpoint, or to save a policy."""
    max_generator_restarts: int = Field(10, ge=0)
    """Generator replacements a run may make before it stops."""
    max_reward_worker_restarts: int = Field(20, ge=0)
    """Reward worker replacements a run may make before it stops."""
    max_learner_restarts: int = Field(3, ge=0)
    """Times the learner group may be restarted from the latest checkpoint after losing a rank."""
    rescore_attempts: int = Field(1, ge=0)
    """Times completions whose reward worker died or hung are scored again (on a new worker) before they are left
    unscored."""
    inject: InjectConfig = Field(default_factory=InjectConfig)
    """Faults injected on purpose (none by default)."""


def _off_as_written(value: Any) -> Any:
    """YAML reads a bare `off` as false: the action `off` as written in a config file or a dotted override."""
    return "off" if value is False else value


HealthAction = Annotated[Literal["off", "warn", "rollback", "stop"], BeforeValidator(_off_as_written)]


class NonFiniteCheck(_Section):
    action: Literal["skip", "rollback", "stop"] = "skip"
    """A step whose loss or gradient norm is not finite (NaN, inf): `skip` (its update is dropped, as the learner
    always drops one, and the run goes on), `rollback`, or `stop`."""


class GradNormCheck(_Section):
    action: HealthAction = "warn"
    """What a gradient norm spike calls for: `off`, `warn`, `rollback`, `stop`. A spike alone warns by default:
    clipping at `learner.max_grad_norm` already bounds what such an update does, and in GRPO the norm jumps when a
    group first gets signal, the moment the policy starts to learn."""
    factor: float = Field(1000.0, gt=1)
    """The check fires when the gradient norm (before clipping) is above this many times the median of the last
    `health.window` steps' (steps whose norm was 0, every advantage 0, left out; judged from the second step on),
    and above `learner.max_grad_norm` (a norm under the clipping threshold moves the weights as a usual step does)."""


class KlCheck(_Section):
    action: HealthAction = "warn"
    """What a KL past `max` calls for: `off`, `warn`, `rollback`, `stop`."""
    max: float = Field(1.0, gt=0)
    """The largest mean per-token KL to the reference (`kl`, logged when there is a reference) a step may show."""


class LogprobGapCheck(_Section):
    action: HealthAction = "warn"
    """What a gap past `max` calls for: `off`, `warn`, `rollback`, `stop`."""
    max: float = Field(1.0, gt=0)
    """The largest mean absolute gap per token between the learner's and the engines' log-probabilities of the
    step's sampled tokens (`logprob_gap`, at its first update) a step may show: past it the engines serve other
    weights than the learner's (a sync went wrong). Judged on batches sampled by the learner's current weights
    only: a batch drawn ahead (`rollout.max_staleness` >= 1) differs by as much as the policy moved in the updates
    since, which a learning run's first steps make large (1.9 per token at k = 2 on the quick start); there the
    check after every sync (`sync.probe`) compares engine and learner at one version."""


class EntropyCheck(_Section):
    action: HealthAction = "rollback"
    """What an entropy collapse calls for: `off`, `warn`, `rollback`, `stop`. A policy that diverges (a learning
    rate far too high, an update that wrecked the weights) shows it here first: its entropy falls in one update."""
    fraction: float = Field(0.1, gt=0, lt=1)
    """The check fires when the mean per-token entropy (`entropy`) falls below this fraction of the median of the
    last `health.window` steps' (judged from the second step on) at a step whose mean reward is below the median of
    the same steps': a collapse, sudden or over a few steps, that cost reward."""
    sudden: float = Field(0.5, gt=0, lt=1)
    """It fires too when the entropy falls below this fraction of the lowest of the last 3 steps' (from the second
    step on) at a step whose mean reward is below each of theirs: one update that threw the policy off (a healthy
    run's entropy falls a few percent a step). A collapse with the reward held is a policy converging on what
    scores (the tests' tiny config goes from 1.95 to 0 nats in one step at its best reward), not a divergence."""
    min_fall: float = Field(0.5, ge=0)
    """Either bound fires only when the entropy fell by at least this many nats per token from that level: a
    policy already sharp (a warmed-up agent's entropy goes from 0.6 to 0.1 in 9 healthy steps) is sharpening, not
    collapsing, as far as the entropy can tell; its divergence shows in the reward and the KL."""


class RewardCheck(_Section):
    action: HealthAction = "warn"
    """What a reward collapse calls for: `off`, `warn`, `rollback`, `stop`."""
    fraction: float = Field(0.25, gt=0, lt=1)
    """The check fires when the mean reward (`reward/mean`) falls below this fraction of the median of the last
    `health.window` steps' (judged only while that median is above zero)."""


class HealthConfig(_Section):
    """Checks after every training step on what the run measures; each has an `action`: `warn` (printed, logged,
    a W&B alert), `rollback` (the learner and the generators back to the latest checkpoint, the batches since
    skipped, the learning rate times `rollback_lr_factor`), `stop` (the run stops, naming the check, the step and
    the figures), `off`."""

    nonfinite: NonFiniteCheck = Field(default_factory=NonFiniteCheck)
    """A loss or gradient norm that is not finite."""
    grad_norm: GradNormCheck = Field(default_factory=GradNormCheck)
    """A gradient norm spiking against its recent median."""
    kl: KlCheck = Field(default_factory=KlCheck)
    """The KL to the reference past a bound."""
    logprob_gap: LogprobGapCheck = Field(default_factory=LogprobGapCheck)
    """The learner's and the engines' log-probabilities of the sampled tokens apart past a bound."""
    entropy: EntropyCheck = Field(default_factory=EntropyCheck)
    """The policy's entropy collapsing against its recent median."""
    reward: RewardCheck = Field(default_factory=RewardCheck)
    """The mean reward collapsing against its recent median."""
    window: int = Field(20, ge=1)
    """Steps in the running medians the gradient norm, entropy and reward are judged against."""
    min_history: int = Field(5, ge=1)
    """Steps of history the reward check waits for before it judges (a small reward varies most); the gradient
    norm and the entropy judge from the second step on."""
    max_rollbacks: int = Field(3, ge=0)
    """Rollbacks a run may make before the next stops it; one check firing again at the step it rolled back from
    stops the run at once (the same cause twice)."""
    rollback_lr_factor: float = Field(1.0, gt=0, le=1)
    """Each rollback multiplies the learning rate by this (1: unchanged)."""


class SftConfig(_Section):
    base: str
    """The model `grpo-dist sft` warms up (a local Hugging Face directory); the result goes to `model.path`."""
    steps: int = Field(500, ge=1)
    """Optimizer steps of the warm-up."""
    batch_size: int = Field(64, ge=1)
    """Solved training rows per step."""
    lr: float = Field(1e-3, gt=0)
    """AdamW learning rate of the warm-up (betas and gradient clipping as in `learner`)."""
    answer_field: str = "answer"
    """Field of each training row holding its solved completion (or, as a list of chat messages, its solved
    conversation: a tool-use transcript whose assistant turns are learned)."""
    rows: int | None = Field(None, ge=1)
    """Warm up on the first this many training rows only (a few solved examples); null: all of them."""


class EnvironmentConfig(_Section):
    name: str = "tools"
    """The environment each trajectory runs in: `tools` (the plain tool-use loop: tool calls answered by their
    results, done at a turn without one) or the dotted path of your `grpo_dist.agents.Environment` subclass."""
    kwargs: Kwargs = Field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""
    tools: list[str] | None = None
    """Tools offered to the model: built-in (`calculator`) or dotted paths of functions; null: the environment's
    own `tools`."""
    agent: str | None = None
    """Bring your own agent: the dotted path of `async def agent(client, row) -> reward`, run for each trajectory with
    an `openai.AsyncOpenAI` client of the generator's chat-completions endpoint (its calls are the trajectory;
    the agent runs its own tools). null: the environment's tool loop."""
    episode_timeout_s: float = Field(300.0, gt=0)
    """An agent running longer is stopped; its trajectory keeps the calls made so far, cut (truncated)."""
    tool_parser: str = "hermes"
    """How tool calls are read from a turn: `hermes` (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`),
    `none`, or the dotted path of a function `(text) -> list[ToolCall]`."""
    max_turns: int = Field(4, ge=1)
    """Model turns per trajectory; one still calling tools at the last is cut (truncated)."""
    max_total_tokens: int = Field(256, ge=2)
    """Prompt, turns and observations together (at most `rollout.max_model_len`); each turn samples at most
    `rollout.max_new_tokens`."""
    tool_timeout_s: float = Field(10.0, gt=0)
    """A tool call running longer is answered with a time-out error; its sandbox is killed with what it started."""
    tool_workers: int = Field(4, ge=1)
    """Tool sandboxes per generator: tool calls running at once (a slow one holds back only its trajectory)."""
    sandbox_memory_mb: int = Field(2048, ge=256)
    """Address space of each tool sandbox."""
    sandbox_network: bool = False
    """Let tools use the network (off: a network namespace of their own)."""
    sandbox_paths: SandboxPaths = []
    """Absolute paths of directories the tool sandboxes see too, at the same path (data a tool reads, a directory it
    writes where `nobody` may), as `reward.sandbox_paths` for the reward sandbox."""


class CheckpointConfig(_Section):
    every_steps: int = Field(50, ge=0)
    """Write a checkpoint every this many steps (and at the last step); 0 writes none."""
    keep: int = Field(3, ge=1)
    """How many of the newest checkpoints to keep."""
    dir: str | None = None
    """Where checkpoints go; null means `<run dir>/checkpoints`. With learner ranks on several nodes it must be
    a filesystem every node shares. With an object-store `run.output_dir` leave it null: checkpoints go there."""
    save_hf: bool = False
    """Also write a Hugging Face copy of the policy into each checkpoint (`hf/`)."""
    allow_data_change: bool = False
    """Let `--resume` go on over training data that changed since the checkpoint (otherwise an error)."""


class EvalSetConfig(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """The set's name, in its metrics (`eval/<name>/...`) and its console line."""
    path: str | None = None
    """Its prompts, in any layout `data.path` takes; null: the run's held-out prompts (`data.eval_path`, or the
    bundled task's)."""
    split: str = "test"
    """The split of `path` (a `save_to_disk` directory of several splits, or a hub dataset)."""
    subset: str | None = None
    """The subset (configuration) of a hub dataset."""
    fields: FieldsConfig | None = None
    """Which columns hold the prompt and the answer; null: `data.fields`."""
    k: int = Field(1, ge=1)
    """Samples per prompt: pass@1 ... pass@k and maj@k are reported."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature; 0 is greedy decoding (one sample: k must be 1)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    max_tokens: int | None = Field(None, ge=1)
    """Longest completion, in tokens; null: `rollout.max_new_tokens`."""
    reward: str | None = None
    """The reward whose value 1.0 counts as correct (a built-in or a dotted path); null: `eval.reward`."""
    max_prompts: int | None = Field(None, ge=1)
    """Prompts evaluated (the first ones); null: `eval.max_prompts`."""

    @model_validator(mode="after")
    def _greedy_is_one_sample(self) -> EvalSetConfig:
        if self.temperature == 0 and self.k > 1:
            raise ValueError(
                f"eval set {self.name}: k={self.k} samples at temperature 0 are one greedy answer {self.k} times; "
                "set a temperature above 0 (e.g. 0.6) or k to 1"
            )
        return self


class EvalConfig(_Section):
    reward: str = "math_answer"
    """Reward function whose value 1.0 counts as a correct answer (every eval set's unless it names its own)."""
    max_prompts: int = Field(200, ge=1)
    """Prompts of each eval set evaluated (the first ones), unless the set says otherwise."""
    every: int = Field(0, ge=0)
    """Evaluate every this many steps, besides before training and after it; 0: before and after only."""
    sets: list[EvalSetConfig] = Field(default_factory=list)
    """The eval sets; empty: one set `held_out`, the run's held-out prompts decoded greedily (k 1)."""
    save_samples: bool = True
    """Write every evaluation's judged samples to `eval_samples/step-NNNNNN.jsonl` in the run directory (set,
    prompt, completion, the answer read from it, correct, length, truncated)."""

    @model_validator(mode="after")
    def _names_distinct(self) -> EvalConfig:
        names = [spec.name for spec in self.sets]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"eval.sets: each set needs a name of its own (given more than once: {twice})")
        return self


class ClusterConfig(_Section):
    gpu_memory_gb: float = Field(80.0, gt=0)
    """Memory of each GPU the run uses, in GB (10^9 bytes): what `grpo-dist plan` and the pre-flight check the
    learner ranks and engines against."""


class RayConfig(_Section):
    address: str | None = None
    """Ray cluster to join (`auto` or `host:port`; one that does not answer fails at once, naming it); null joins
    the local cluster `grpo-dist up` started when it is up, else starts a local cluster for this run (even where
    another Ray cluster runs on the machine)."""
    num_cpus: int | None = Field(None, ge=1)
    """Logical CPUs of the local cluster; null means at least what the actors ask for."""
    placement_timeout_s: float = Field(60.0, gt=0)
    """A run whose actors cannot all be placed within this many seconds fails, listing what it asked for and what
    the cluster has."""


class WandbConfig(_Section):
    enabled: bool = True
    """Log to Weights & Biases (offline, to the run directory, when no API key is set)."""
    project: str = "grpo-dist"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); null: the API key's default."""
    name: str | None = Field(None, validation_alias=AliasChoices("name", "run_name"))
    """W&B run name; defaults to `run.name` (`run_name`, its earlier key, is read too)."""
    group: str | None = None
    """W&B group, to compare runs of one experiment side by side."""
    tags: list[str] = Field(default_factory=list)
    """W&B tags."""
    notes: str | None = None
    """W&B notes: a line on what this run tries."""
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """`auto` follows W&B's own switches (WANDB_MODE, WANDB_DISABLED) when set; else online with credentials
    (WANDB_API_KEY, or `wandb login`'s netrc entry), offline without."""
    table_every: int = Field(10, ge=0)
    """Log a table of sampled completions every this many steps (and at the first); 0: none."""
    table_rows: int = Field(32, ge=1)
    """Rows of each completion table (the first groups of the step's batch, whole)."""
    finish_timeout_s: float = Field(120.0, gt=0)
    """The longest the run waits for W&B to finish uploading at its end; past it the run ends anyway, its W&B files
    kept in the run directory (`wandb sync` uploads them)."""
