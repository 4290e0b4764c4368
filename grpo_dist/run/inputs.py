"""What a config points at, resolved and checked before any actor starts: the model (built first when `model.tiny`
asks for one), its tokenizer, the training and held-out prompts (read and tokenised), and the reward functions.

`grpo-dist train`, `grpo-dist sft` and `grpo-dist check` all go through here, so a config `check` passes does not
fail later on its inputs. `prepare(cfg, scratch=...)` (what `check` uses) builds what it has to build (a tiny model,
a bundled task's data) under `scratch` instead of the run's own paths, and leaves those untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_dist.config import RESERVED_FIELDS, Config, ConfigError, EvalSetConfig
from grpo_dist.config.plan import check_plan
from grpo_dist.data import PromptRecord, encode_prompts, split_task
from grpo_dist.data.sources import read_source
from grpo_dist.models.hub import HUB_ID, max_positions, snapshot
from grpo_dist.rewards.runner import RewardRunner
from grpo_dist.sandbox import SandboxError, jail


@dataclass
class EvalSet:
    """One eval set, resolved: its settings with the config's defaults filled in, and its prompts."""

    name: str
    k: int  # samples per prompt
    temperature: float  # 0: greedy
    top_p: float
    max_tokens: int
    reward: str  # the judge: 1.0 is correct
    prompts: list[PromptRecord]  # at most the set's max_prompts


@dataclass
class Inputs:
    """Everything a run reads, checked and tokenised."""

    model_path: str  # absolute path of the Hugging Face model directory every actor loads
    pad_token_id: int
    train: list[PromptRecord]
    eval_sets: list[EvalSet]  # empty when there are no held-out prompts and no eval sets


def prepare(cfg: Config, scratch: Path | None = None, model_files: list[str] | None = None) -> Inputs:
    """Build or check the model, read and tokenise the data, resolve the rewards: fail here, not in an actor.
    `scratch`: where to build what the config asks to be built, instead of its own paths (a dry run);
    `model_files`: the hub model's files it needs (`prepare_model`), all when None."""
    rewards = check_rewards(cfg)  # its sandbox imports the functions while the model, tokenizer and data load
    try:
        model_path = prepare_model(cfg, scratch, model_files)
        teacher, scorer = teacher_directory(cfg), reward_model_directory(cfg, model_files)
        if cfg.learner.num_gpus > 0 or cfg.rollout.num_gpus > 0:
            check_plan(cfg, model_path, teacher, scorer)
        tokenizer = load_tokenizer(model_path)
        check_lengths(cfg, model_path)
        if cfg.learner.lora is not None:
            check_lora_targets(cfg, model_path)
        processor = load_processor(cfg, model_path)
        train_path, eval_path = prepare_data(cfg, scratch)
        train, skipped = read_prompts(cfg, train_path, tokenizer, processor=processor)
        if len(train) < cfg.data.prompts_per_step:
            raise ConfigError(
                f"data.prompts_per_step ({cfg.data.prompts_per_step}) is more than the {len(train)} usable training "
                f"prompts of {train_path}: a step would repeat prompts; lower it or add data"
            )
        if skipped:
            print(f"skipped {skipped} training prompts longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
        held_out = read_prompts(cfg, eval_path, tokenizer, True, processor)[0] if eval_path is not None else []
        rewards_ready(rewards)
        show_first_prompt(cfg, train[0], tokenizer)
        if cfg.environment is not None:
            check_environment(cfg, tokenizer, train[0])
        if cfg.reward.judge is not None:
            check_judge(cfg)
        if teacher is not None:
            check_teacher(cfg, tokenizer, model_path, teacher)
        if scorer is not None:
            check_reward_model_reads(cfg, scorer, train[0])
        check_answer(cfg, rewards, train[0], "data.path", cfg.eval.reward)
        eval_sets = read_eval_sets(cfg, held_out, tokenizer, processor)
        for each, key in eval_sets:
            check_answer(cfg, rewards, each.prompts[0], key, each.reward)
    except Exception:
        rewards_ready(rewards)  # a reward function that does not import is said first, as when it was waited for
        raise
    finally:
        rewards.close()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Inputs(model_path, pad, train, [each for each, _ in eval_sets])


def read_eval_sets(
    cfg: Config, held_out: list[PromptRecord], tokenizer: Any, processor: Any = None
) -> list[tuple[EvalSet, str]]:
    """Each eval set with its prompts, and the key its prompts come from (for errors); `eval.sets` empty: the
    held-out prompts, decoded greedily, as the set `held_out`. A set must have prompts and room for its
    completions in `rollout.max_model_len`. A set's images are read as the training data's (`processor`)."""
    specs = cfg.eval.sets or ([EvalSetConfig(name="held_out")] if held_out else [])
    sets = []
    for number, spec in enumerate(specs):
        key = f"eval.sets.{number}.path" if cfg.eval.sets else "data.eval_path"
        if spec.path is None:
            prompts = held_out
            if not prompts:
                raise ConfigError(
                    f"eval.sets.{number} ({spec.name}) has no path and the run has no held-out prompts "
                    "(data.eval_path, or data.task): give the set a path"
                )
            key = "data.eval_path"
        else:
            fields = spec.fields or cfg.data.fields.model_copy(update={"images": cfg.data.images_column})
            if fields.images is not None and processor is None:
                raise ConfigError(
                    f"eval.sets.{number}.fields.images: the training prompts carry no images, so the model is not"
                    " read as a vision-language model; give the training data its images too (data.fields.images)"
                )
            rows = read_source(spec.path, spec.split, spec.subset, fields, key)
            check_fields(rows, key, spec.path)
            prompts, _ = encode_prompts(
                rows,
                tokenizer,
                cfg.data.max_prompt_tokens,
                cfg.data.system_prompt,
                cfg.data.chat_template,
                template_tools(cfg),
                processor if fields.images is not None else None,
            )
            if not prompts:
                raise ConfigError(f"{key}: {spec.path} holds no prompt within data.max_prompt_tokens")
        max_tokens = spec.max_tokens or cfg.rollout.max_new_tokens
        if cfg.data.max_prompt_tokens + max_tokens > cfg.rollout.max_model_len:
            raise ConfigError(
                f"eval set {spec.name}: data.max_prompt_tokens ({cfg.data.max_prompt_tokens}) + its max_tokens "
                f"({max_tokens}) exceeds rollout.max_model_len ({cfg.rollout.max_model_len})"
            )
        reward = spec.reward or cfg.eval.reward
        limit = spec.max_prompts or cfg.eval.max_prompts
        each = EvalSet(spec.name, spec.k, spec.temperature, spec.top_p, max_tokens, reward, prompts[:limit])
        sets.append((each, key))
    return sets


PREFLIGHT_TIMEOUT_S = 60.0
"""The least time the pre-flight gives one reward call (`reward.timeout_s` when longer)."""


def check_rewards(cfg: Config) -> RewardRunner:
    """Every reward function the config names (training, then the eval judges) resolves to a callable: imported
    where they will run (the sandbox, by default), never in this process. Returns them, to score as the reward
    workers will once `rewards_ready` has waited for their sandbox, which starts meanwhile (the caller closes it).
    Where the model's code runs, the isolation `reward.isolation` asks for must be there (said once on the
    console)."""
    try:
        if cfg.model_code_runs:
            found = jail.check(jail.Isolation(cfg.reward.isolation), "the code_tests reward or the python tool")
            print(f"sandbox: {found.describe()}")
        # A reward's first call may import what it needs, seconds on a busy machine: the check is whether the reward
        # reads the data, not its speed, so it is bounded by PREFLIGHT_TIMEOUT_S at least. The built-ins are not
        # warmed up here (math_answer's sympy, 0.8 CPU seconds): the check calls at most the eval judges, once a
        # set, and math_answer needs sympy only for an answer that is not a plain integer. A user's function's
        # warm-up still runs here, so that one that raises is said before the run starts.
        reward = cfg.reward.model_copy(update={"timeout_s": max(cfg.reward.timeout_s, PREFLIGHT_TIMEOUT_S)})
        names = [spec.name for spec in cfg.reward.functions] + cfg.judges
        return RewardRunner(names, reward, wait=False, warm_builtins=False)
    except (ValueError, SandboxError, jail.IsolationRefused) as err:
        raise ConfigError(str(err)) from None


def rewards_ready(rewards: RewardRunner) -> None:
    """Wait for `check_rewards`' sandbox: a reward function that did not import there is a `ConfigError`."""
    try:
        rewards.ready()
    except SandboxError as err:
        raise ConfigError(str(err)) from None


def show_first_prompt(cfg: Config, record: PromptRecord, tokenizer: Any) -> None:
    """Print the first prompt as the model reads it: its tokens decoded, so characters the tokenizer cannot encode
    (a tiny model's `characters`) show as missing, and are named."""
    read = tokenizer.decode(record.token_ids, skip_special_tokens=False)
    print(f"first prompt, as the model reads it: {read!r}")
    if record.images:
        from grpo_dist.models.vision import describe

        named = record.image_sources or [f"{cfg.data.images_column}[{at}]" for at in range(len(record.images))]
        shown = ", ".join(describe(image, name) for image, name in zip(record.images, named, strict=True))
        print(f"  its images ({cfg.data.images_column}): {shown}")
    lost = sorted(set(record.text) - set(read))
    if lost:
        where = " (model.tiny.characters)" if cfg.model.tiny is not None else ""
        print(f"warning: the tokenizer of model.path drops characters of the prompts: {''.join(lost)!r}{where}")


def check_answer(cfg: Config, rewards: RewardRunner, record: PromptRecord, key: str, name: str) -> None:
    """The reference answer of a dataset's first row, given as the completion, must score 1.0 with the judge `name`
    (one of `rewards`' eval judges): otherwise the answer column or the reward's parser is wrong, and every step
    would learn from noise. Bounded by reward.timeout_s, and at least `PREFLIGHT_TIMEOUT_S`."""
    if "answer" not in record.fields:
        return
    answer = record.fields["answer"]
    judge = len(cfg.reward.functions) + cfg.judges.index(name)
    score, _, errors = rewards.score([judge], [1.0], [{}], record.text, str(answer), record.fields)
    if errors[0] is not None:
        raise ConfigError(f"eval.reward={name} failed on the first row of {key}: {errors[0]}")
    if score != 1.0:
        raise ConfigError(
            f"{key}: the first row's answer {str(answer)[:100]!r}, given as the completion, scores {score} with "
            f"eval.reward={name}, not 1.0: the reward cannot read the column mapped to the answer (data.fields.answer="
            f"{cfg.data.fields.answer}) as an answer. Map the column that holds the final answer (`grpo-dist prepare "
            "gsm8k|math|...` extracts it from a worked solution), or judge with a reward that reads this one "
            "(eval.reward, e.g. exact_answer for text)"
        )


def check_environment(cfg: Config, tokenizer: Any, record: PromptRecord) -> None:
    """The environment, its tools and its tool parser resolve, the chat template renders an observation after a
    turn, the first row starts an episode within `data.max_prompt_tokens`, and the tools import in their sandbox."""
    from grpo_dist.agents.episode import AgentLoop
    from grpo_dist.agents.render import TemplateError
    from grpo_dist.sandbox import Sandbox

    try:
        loop = AgentLoop(
            cfg.environment, tokenizer, cfg.rollout.max_new_tokens, cfg.reward.isolation, cfg.reward.sandbox_env
        )
        first = loop.first_tokens(record.row)
        loop.renderer.observation([{"role": "tool", "content": "0"}])
        if loop.specs:
            Sandbox([spec.path for spec in loop.specs], loop.tools.limits, kind="tools").close()
    except (ValueError, TemplateError, SandboxError) as error:
        raise ConfigError(f"environment: {error}") from None
    except Exception as error:  # the user's environment failing on its first row
        raise ConfigError(
            f"environment {cfg.environment.name}: reset of the first row of data.path raised "
            f"{type(error).__name__}: {error}"
        ) from None
    if len(first) > cfg.data.max_prompt_tokens:
        raise ConfigError(
            f"environment {cfg.environment.name}: the first row's first messages take {len(first)} "
            f"tokens, more than data.max_prompt_tokens ({cfg.data.max_prompt_tokens})"
        )


def check_judge(cfg: Config) -> None:
    """`reward.judge.model` is a model directory (or a hub id, fetched now), before any engine starts."""
    from grpo_dist.cluster.judge_pool import judge_model

    try:
        found = Path(judge_model(cfg.reward.judge))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if not (found / "config.json").is_file():
        raise ConfigError(f"reward.judge.model: {found} is not a Hugging Face model directory (no config.json)")


def reward_model_directory(cfg: Config, files: list[str] | None = None) -> str | None:
    """`reward.model.path`'s directory (a hub id's snapshot fetched now, only `files` when given), checked to hold a
    sequence classifier with the label `reward.model.label`, before any actor starts; None without a reward
    model."""
    import json

    from grpo_dist.cluster.reward_model_pool import reward_model_path

    settings = cfg.reward.model
    if settings is None:
        return None
    try:
        found = Path(reward_model_path(settings, files))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if not (found / "config.json").is_file():
        raise ConfigError(f"reward.model.path: {found} is not a Hugging Face model directory (no config.json)")
    config = json.loads((found / "config.json").read_text())
    kinds = config.get("architectures") or []
    if not any(kind.endswith("ForSequenceClassification") for kind in kinds):
        raise ConfigError(
            f"reward.model.path: {found} is a {', '.join(kinds) or 'model of no named architecture'}, not a sequence "
            "classifier (…ForSequenceClassification): a reward model scores a completion with one logit a label"
        )
    labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
    if settings.label >= labels:
        raise ConfigError(
            f"reward.model.label: {settings.label}, and {found} has {labels} label(s) (0 to {labels - 1})"
        )
    return str(found)


def check_reward_model_reads(cfg: Config, scorer: str, first: PromptRecord) -> None:
    """The reward model (in directory `scorer`) holds `reward.model.max_length` positions, and its tokenizer renders
    the first training prompt's conversation with an answer (its chat template may refuse a system turn, or turns
    that do not alternate): refused here, not at the first step's scoring."""
    from jinja2 import TemplateError
    from transformers import AutoTokenizer

    from grpo_dist.cluster.actors.classifier import reward_model_tokens

    positions = max_positions(scorer)
    length = cfg.reward.model.length(positions)
    if positions is not None and length > positions:
        raise ConfigError(
            f"reward.model.max_length ({length}) is above the reward model's {positions} positions "
            f"({Path(scorer) / 'config.json'}): lower it to at most {positions}"
        )
    try:
        reward_model_tokens(AutoTokenizer.from_pretrained(scorer), length, first.messages, first.text, "answer")
    except (TemplateError, ValueError, TypeError, KeyError) as error:  # a template's refusal (raise_exception)
        raise ConfigError(
            f"reward.model: its tokenizer cannot read the first training prompt's conversation with an answer "
            f"({type(error).__name__}: {error}); its chat template gets the row's turns, then the answer as the "
            "assistant's"
        ) from None


def teacher_directory(cfg: Config, files: list[str] | None = None) -> str | None:
    """`algorithm.distill.teacher`'s directory (a hub id's snapshot fetched now, only `files` when given), checked
    to hold a Hugging Face model; None without distillation."""
    from grpo_dist.cluster.teacher_pool import teacher_model

    if cfg.algorithm.distill is None:
        return None
    try:
        found = Path(teacher_model(cfg.algorithm.distill, files))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if not (found / "config.json").is_file():
        raise ConfigError(f"algorithm.distill.teacher: {found} is not a Hugging Face model directory (no config.json)")
    return str(found)


def check_teacher(cfg: Config, tokenizer: Any, model_path: str, teacher: str) -> None:
    """The teacher (in directory `teacher`) holds the run's context and reads token ids as the student does: the
    same vocabulary and ids. Distillation compares the two models' log-probs of the same token ids, so a teacher
    with another tokenizer is refused here, before any engine starts."""
    from transformers import AutoTokenizer

    found = Path(teacher)
    positions = max_positions(found)
    if positions is not None and cfg.rollout.max_model_len > positions:
        raise ConfigError(
            f"algorithm.distill.teacher: rollout.max_model_len ({cfg.rollout.max_model_len}) is above the teacher's "
            f"{positions} positions ({found / 'config.json'}): lower it to at most {positions}"
        )
    differs = tokenizer_difference(tokenizer, AutoTokenizer.from_pretrained(found))
    if differs:
        raise ConfigError(
            f"algorithm.distill.teacher: {found} has another tokenizer than the student ({model_path}): {differs}. "
            "The teacher scores the student's own token ids, so it must use the student's tokenizer"
        )
    rollout = cfg.rollout
    if rollout.temperature != 1.0 or rollout.top_p != 1.0:
        print(
            f"note: distillation compares the sampling distribution (rollout.temperature {rollout.temperature:g}, "
            f"top_p {rollout.top_p:g}) with the teacher's at temperature 1; sample at 1 and 1 to distil the teacher "
            "itself"
        )


def tokenizer_difference(student: Any, teacher: Any) -> str | None:
    """What differs between two tokenizers' vocabularies (token -> id, added tokens included), in words; None when
    nothing does."""
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if mine != theirs:
        other = sorted(token for token in mine.keys() | theirs.keys() if mine.get(token) != theirs.get(token))
        token = other[0]
        return (
            f"{len(other)} tokens differ (the student has {len(mine)}, the teacher {len(theirs)}); e.g. {token!r} is "
            f"{mine.get(token, 'missing')} in the student and {theirs.get(token, 'missing')} in the teacher"
        )
    return None


def check_lengths(cfg: Config, model_path: str) -> None:
    """The lengths asked for fit each other and the model's positions."""
    positions = max_positions(model_path)
    if positions is not None and cfg.rollout.max_model_len > positions:
        raise ConfigError(
            f"rollout.max_model_len ({cfg.rollout.max_model_len}) is above the {positions} positions of the model "
            f"(max_position_embeddings in {Path(model_path) / 'config.json'}): lower it to at most {positions}"
        )
    if cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens > cfg.rollout.max_model_len:
        raise ConfigError(
            f"data.max_prompt_tokens ({cfg.data.max_prompt_tokens}) + rollout.max_new_tokens "
            f"({cfg.rollout.max_new_tokens}) exceeds rollout.max_model_len ({cfg.rollout.max_model_len})"
        )


def check_lora_targets(cfg: Config, model_path: str) -> None:
    """`learner.lora.target_modules` name linear layers of the model (built without weights, on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_dist.models import lora  # torch and PEFT: only for a LoRA run

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    try:
        lora.check_targets(model, cfg.learner.lora.target_modules)
    except ValueError as error:
        raise ConfigError(f"{error}; the model is {model_path}") from None


QWEN2_TOKENIZER_MODELS = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
"""The model types whose tokenizer `AutoTokenizer` loads as the `Qwen2Tokenizer` their tokenizer_config.json names
(transformers' own mapping for them; a test holds this list to it): the tiny models grpo-dist builds among them."""


def load_tokenizer(model_path: str) -> Any:
    """The model's tokenizer, as `AutoTokenizer` loads it. Where its files name a `Qwen2Tokenizer` for a model type
    that maps to it and no code of their own, that class loads it directly: importing `AutoTokenizer` imports torch
    and transformers' model registry (about 5 s on 2 cores, in a driver that reads a tiny model's tokenizer in
    milliseconds)."""
    import transformers

    if qwen2_tokenizer(Path(model_path)):
        return transformers.Qwen2Tokenizer.from_pretrained(model_path)
    return transformers.AutoTokenizer.from_pretrained(model_path)


def qwen2_tokenizer(model_dir: Path) -> bool:
    """Whether `AutoTokenizer` would load the tokenizer in `model_dir` as `Qwen2Tokenizer` (`load_tokenizer`)."""
    import json

    try:
        tokenizer = json.loads((model_dir / "tokenizer_config.json").read_text())
        model = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(tokenizer, dict)
        and isinstance(model, dict)
        and tokenizer.get("tokenizer_class") == "Qwen2Tokenizer"
        and "auto_map" not in tokenizer
        and "auto_map" not in model
        and model.get("model_type") in QWEN2_TOKENIZER_MODELS
        # AutoTokenizer matches a hub id recorded here against checkpoints it loads otherwise; a path never matches
        and str(model.get("_name_or_path", "/")).startswith("/")
    )


def read_prompts(
    cfg: Config, location: str, tokenizer: Any, held_out: bool = False, processor: Any = None
) -> tuple[list[PromptRecord], int]:
    """The training (or held-out) prompts at `location`, mapped and rendered as the model reads them, tokenised
    (with their images, through `processor`, where the data has them: `load_processor`); returns the records and
    how many were over the length limit."""
    data = cfg.data
    split, key = (data.eval_split, "data.eval_path") if held_out else (data.split, "data.path")
    fields = data.fields.model_copy(update={"images": data.images_column})
    rows = read_source(location, split, data.subset, fields, key)
    check_fields(rows, key, location)
    return encode_prompts(
        rows, tokenizer, data.max_prompt_tokens, data.system_prompt, data.chat_template, template_tools(cfg), processor
    )


def load_processor(cfg: Config, model_path: str) -> Any:
    """The model's processor where the prompts carry images (`data.images_column`), else None. Raises
    `ConfigError` where the model is not a vision-language model (no processor that reads images, or no chat
    template to place them)."""
    if cfg.data.images_column is None:
        return None
    from transformers import AutoProcessor

    from grpo_dist.models.vision import SUPPORTED, is_vision_model, model_type

    if is_vision_model(model_path) and (kind := model_type(model_path)) not in SUPPORTED:
        raise ConfigError(
            f"the prompts carry images, and model.path {model_path} is a {kind} model, whose processor's pixel layout"
            f" the learner does not combine yet (it does for {', '.join(SUPPORTED)})"
        )

    try:
        processor = AutoProcessor.from_pretrained(model_path)
    except (OSError, ValueError) as err:
        processor, why = None, f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
    else:
        why = "its processor reads no images"
    if processor is None or getattr(processor, "image_processor", None) is None:
        raise ConfigError(
            f"the prompts carry images (data.fields.images, or the color task), and model.path {model_path} is not a"
            f" vision-language model ({why}): name one whose processor reads images (model.tiny.vision for a tiny one)"
        )
    if not getattr(processor.tokenizer, "chat_template", None):
        raise ConfigError(
            f"the prompts carry images, and the tokenizer of model.path {model_path} has no chat template to place"
            " them with"
        )
    return processor


def check_fields(rows: list[dict[str, Any]], key: str, location: str) -> None:
    """No row of the data at `location` (config key `key`) has a field named as a setting of the jail
    (`config.RESERVED_FIELDS`): a row's fields are passed to the reward functions as keyword arguments, and a
    setting belongs to the config. Raises `ConfigError` naming the first such row (its 0-based index) and field."""
    for index, row in enumerate(rows):
        reserved = [name for name in RESERVED_FIELDS if name in row]
        if reserved:
            raise ConfigError(
                f"{key}: row {index} (0-based) of {location} has the field {reserved[0]!r}, a name reserved for "
                f"the config's {RESERVED_FIELDS[reserved[0]]}: a row's fields reach the reward functions as keyword "
                "arguments, and a row must not set how its completions are judged. Rename or drop that column "
                f"(reserved names: {', '.join(RESERVED_FIELDS)})"
            )


def template_tools(cfg: Config) -> list[dict] | None:
    """The chat template's `tools` of a run with an environment (its prompts show them), else None."""
    if cfg.environment is None:
        return None
    from grpo_dist.agents.episode import tool_specs

    try:
        return [spec.chat_template_entry for spec in tool_specs(cfg.environment)]
    except ValueError as error:
        raise ConfigError(str(error)) from None


def prepare_model(cfg: Config, scratch: Path | None = None, files: list[str] | None = None) -> str:
    """The policy's model directory (`model.path`), built first when `model.tiny` asks for one, downloaded (or found
    in the Hugging Face cache) when it names a hub model: only the files matching `files` when given
    (`hub.CONFIG_FILES` to size it, `hub.TOKENIZER_FILES` to check a config against it), else all it loads."""
    path = Path(cfg.model.path).expanduser()
    if cfg.sft is not None and not path.exists():
        raise ConfigError(
            f"model.path: {path} does not exist yet: this config starts from a warmed-up model, which "
            "`grpo-dist sft CONFIG` writes there (see its sft section)"
        )
    if (found := hub_model(cfg, files)) is not None:
        return model_directory(cfg, found, "model.path")
    if cfg.model.revision is not None:
        raise ConfigError(f"model.revision applies to a hub id; model.path {cfg.model.path} is a directory")
    return model_directory(cfg, path, "model.path", scratch, files)


def hub_model(cfg: Config, files: list[str] | None = None, say: bool = True, offline_only: bool = False) -> Path | None:
    """The snapshot of the hub model `model.path` names (only the files matching `files` when given, else one with
    its weights), downloaded or found in the Hugging Face cache; None where `model.path` is a directory, a tiny model
    or where the config's `grpo-dist sft` writes, and with `offline_only` where the hub may be reached. Needs neither
    torch nor transformers: `train` calls it offline before its driver's imports, a lookup in the cache, so that a
    model it cannot have is refused before anything else. `say`: print where it is."""
    if cfg.model.tiny is not None or cfg.sft is not None or not HUB_ID.fullmatch(cfg.model.path):
        return None
    if Path(cfg.model.path).expanduser().exists():
        return None
    if offline_only:
        from huggingface_hub import constants

        if not constants.HF_HUB_OFFLINE:
            return None
    found = Path(snapshot(cfg.model.path, cfg.model.revision, "model.path", files=files, say=say))
    if files is None and not any(found.glob("*.safetensors")) and not any(found.glob("*.bin")):
        raise ConfigError(
            f"model.path: {cfg.model.path}@{cfg.model.revision or 'main'} in the Hugging Face cache holds no "
            f"weights ({found} has {', '.join(sorted(p.name for p in found.iterdir())) or 'nothing'}: what "
            "`grpo-dist plan` or `check` fetched): run where the hub can be reached, or download it "
            f"(`hf download {cfg.model.path}`)"
        )
    return found


def model_directory(
    cfg: Config, path: Path, key: str, scratch: Path | None = None, files: list[str] | None = None
) -> str:
    """The Hugging Face model at `path` (config key `key`), built there first (under `scratch` when given) when
    `model.tiny` asks for one: without its weights in a dry run's `scratch` where `files` names what it reads (a
    check or plan throws the model away; a vision model is always built whole, its processor read with it)."""
    if cfg.model.tiny is not None and not path.exists():
        from grpo_dist.models import build_tiny_model
        from grpo_dist.models.tiny import CHAT_TEMPLATE

        path = path if scratch is None else scratch / "model"
        weights = scratch is None or files is None  # a model that stays (model.path) has them; a dry run's need not
        sizes = cfg.model.tiny.model_dump(exclude_none=True, exclude={"chat_template", "vision"})
        if cfg.model.tiny.vision:  # its own chat template places a prompt's images
            from grpo_dist.models.tiny_vision import build_tiny_vision_model

            build_tiny_vision_model(path, seed=cfg.run.seed, **sizes)
            kind = "random-init tiny vision-language model"
        else:
            template = CHAT_TEMPLATE if cfg.model.tiny.chat_template else None
            build_tiny_model(path, seed=cfg.run.seed, chat_template=template, weights=weights, **sizes)
            kind = "random-init tiny model" if weights else "tiny model's tokenizer and config (no weights)"
        print(f"built a {kind} at {path}")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{key}: {path} is not a Hugging Face model directory (no config.json)")
    return str(path.resolve())


def prepare_data(cfg: Config, scratch: Path | None = None) -> tuple[str, str | None]:
    """The training and held-out data: the configured ones, or a bundled task's files, written into the run
    directory (under `scratch` when given)."""
    data = cfg.data
    if data.task is None:
        return data.path, data.eval_path
    task = data.task
    train, held_out = split_task(
        task.name, (scratch or cfg.run_dir) / "data", task.num_train, task.num_eval, cfg.run.seed
    )
    return str(train), str(held_out)
