"""Supervised warm-up: `grpo-dist sft CONFIG` teaches the config's base model its task's answer format.

The model at `sft.base` (a random-init tiny model is built there when `model.tiny` is set and it does not exist) is
trained on the config's own training rows, each prompt followed by its solved completion (the row's
`sft.answer_field`, then the end-of-sequence token), with the cross-entropy of the completion tokens only. The
result is saved as a Hugging Face model at `model.path`, the policy `grpo-dist train CONFIG` then starts from.
Greedy held-out accuracy, judged as `grpo-dist train` judges it (`eval.reward`), is printed before and after.

It runs in this process with plain torch (one GPU when there is one): a warm-up is short, and needs neither Ray
nor vLLM nor DeepSpeed. Prompts get the chat template as in training and are skipped, as there, when longer than
`data.max_prompt_tokens`. The model is written under a temporary name and renamed, so an interrupted warm-up
leaves nothing at `model.path`. On a CPU machine whose cores several runs share (`GRPO_DIST_CPU_SHARE`), it takes
its share of them, as a learner rank does.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from grpo_dist.cluster.ray_cluster import cpu_share, share_of_cores
from grpo_dist.config import Config, ConfigError
from grpo_dist.data import DatasetError, PromptRecord, encode_prompts
from grpo_dist.data.sources import read_source
from grpo_dist.run.evaluation import judge_accuracy
from grpo_dist.run.inputs import load_tokenizer, model_directory, prepare_data, read_prompts
from grpo_dist.types import ScoreRequest

EVAL_BATCH = 100
"""Held-out prompts generated at once."""


@dataclass(frozen=True)
class Example:
    """One solved training row, tokenised."""

    prompt_ids: list[int]  # the prompt after the chat template
    completion_ids: list[int]  # the answer, then the end-of-sequence token; of a transcript, its turns after the prompt
    targets: list[int] | None = None  # of a transcript: 1 on the assistant's tokens (learned), 0 on observations


def run_sft(cfg: Config, overwrite: bool = False) -> Path:
    """Warm the base model up on the training rows and save it at `model.path`; return that directory."""
    from transformers import AutoModelForCausalLM

    out_dir = _check_output(cfg, overwrite)
    base = model_directory(cfg, Path(cfg.sft.base), "sft.base")
    tokenizer = load_tokenizer(base)
    train_path, eval_path = prepare_data(cfg)
    examples = _examples(cfg, train_path, tokenizer)
    held_out = read_prompts(cfg, eval_path, tokenizer)[0][: cfg.eval.max_prompts] if eval_path else []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and (runs_sharing := cpu_share()) > 1:  # its share of the cores, as a learner rank takes
        torch.set_num_threads(share_of_cores(runs_sharing))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(device)
    print(f"supervised warm-up of {base} on {len(examples)} solved rows of {train_path}")
    if cfg.environment is not None:  # held-out accuracy needs the episodes: `grpo-dist train`'s step-0 evaluation
        held_out = []
    _report_accuracy(cfg, model, tokenizer, held_out, "before warm-up")
    _train(cfg, model, examples, tokenizer.pad_token_id or 0)
    _report_accuracy(cfg, model, tokenizer, held_out, "after warm-up")
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    partial.rename(out_dir)
    print(f"warmed-up model written to {out_dir}; `grpo-dist train` starts from it (model.path)")
    return out_dir


def _check_output(cfg: Config, overwrite: bool) -> Path:
    if cfg.sft is None:
        raise ConfigError("the config has no sft section: add one (sft.base, sft.steps, ...) to warm a model up")
    out_dir = Path(cfg.model.path)
    if out_dir.exists() and not overwrite:
        raise ConfigError(
            f"model.path: {out_dir} exists already; `grpo-dist sft` writes the warmed-up model there: remove it or "
            "pass --overwrite"
        )
    return out_dir


def _examples(cfg: Config, train_path: str, tokenizer: Any) -> list[Example]:
    """Each training row's prompt and solved completion; a row without the answer field is named and refused."""
    data = cfg.data
    field = "answer" if cfg.sft.answer_field == data.fields.answer else cfg.sft.answer_field  # mapped to `answer`
    rows = read_source(train_path, data.split, data.subset, data.fields, "data.path")[: cfg.sft.rows]
    for number, row in enumerate(rows, start=1):
        if not isinstance(row.get(field), str | int | float | list):
            raise DatasetError(f"{train_path}: row {number}: no {field!r} field to learn from (sft.answer_field)")
    records, _ = encode_prompts(rows, tokenizer, data.max_prompt_tokens, data.system_prompt, data.chat_template)
    if isinstance(rows[0][field], list):
        return [
            _transcript(cfg, tokenizer, rows[record.index][field], f"{train_path}: row {record.index + 1}")
            for record in records
        ]
    eos = [tokenizer.eos_token_id]
    return [
        Example(
            record.token_ids,
            list(tokenizer(str(rows[record.index][field]), add_special_tokens=False)["input_ids"]) + eos,
        )
        for record in records
    ]


def _transcript(cfg: Config, tokenizer: Any, messages: list[dict], where: str) -> Example:
    """A solved conversation, tokenised as a trajectory is (`grpo_dist.agents.render`): its messages before the
    first assistant turn as the prompt, then each assistant turn (learned) and the observations between them (not
    learned, their tokens rendered as in an episode)."""
    from grpo_dist.agents.render import Renderer
    from grpo_dist.data.dataset import prompt_turns
    from grpo_dist.run.inputs import template_tools

    first = next((i for i, message in enumerate(messages) if message.get("role") == "assistant"), None)
    if not first or messages[-1].get("role") != "assistant":
        raise DatasetError(f"{where}: a transcript must open with the prompt's messages and end on an assistant turn")
    renderer = Renderer(tokenizer, template_tools(cfg) or [])
    prompt = renderer.first(prompt_turns({"messages": messages[:first]}, cfg.data.system_prompt))
    tokens, targets, observed = [], [], []
    for message in messages[first:]:
        if message["role"] != "assistant":
            observed.append(message)
            continue
        if observed:
            part = renderer.observation(observed)
            tokens, targets, observed = tokens + part, targets + [0] * len(part), []
        part = renderer.turn(message["content"])
        tokens, targets = tokens + part, targets + [1] * len(part)
    return Example(prompt, tokens, targets)


def _train(cfg: Config, model: torch.nn.Module, examples: list[Example], pad_id: int) -> None:
    sft = cfg.sft
    optimizer = torch.optim.AdamW(model.parameters(), lr=sft.lr, betas=cfg.learner.betas)
    order_rng = random.Random(cfg.run.seed)
    order: list[int] = []
    model.train()
    with tqdm(range(1, sft.steps + 1), desc="warm-up", unit="step") as progress:
        for step in progress:
            if len(order) < sft.batch_size:
                order += order_rng.sample(range(len(examples)), len(examples))  # a fresh shuffle per epoch
            batch, order = [examples[index] for index in order[: sft.batch_size]], order[sft.batch_size :]
            loss = _completion_loss(model, batch, pad_id)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.learner.max_grad_norm)
            optimizer.step()
            if step % 10 == 0 or step == sft.steps:
                progress.set_postfix(loss=f"{loss.item():.3f}")
    print(f"warm-up: {sft.steps} steps of {sft.batch_size} rows, last loss {loss.item():.3f}")


def _completion_loss(model: torch.nn.Module, batch: list[Example], pad_id: int) -> torch.Tensor:
    """Mean cross-entropy of the completion tokens of a right-padded batch."""
    length = max(len(ex.prompt_ids) + len(ex.completion_ids) for ex in batch)
    input_ids = torch.full((len(batch), length), pad_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((len(batch), length), dtype=torch.long)  # [B, T]
    labels = torch.full((len(batch), length), -100, dtype=torch.long)  # [B, T]; -100: not a target
    for row, ex in enumerate(batch):
        tokens = ex.prompt_ids + ex.completion_ids
        input_ids[row, : len(tokens)] = torch.tensor(tokens)
        attention_mask[row, : len(tokens)] = 1
        learned = torch.tensor(ex.completion_ids)
        if ex.targets is not None:
            learned[torch.tensor(ex.targets) == 0] = -100
        labels[row, len(ex.prompt_ids) : len(tokens)] = learned
    device = next(model.parameters()).device
    return model(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), labels=labels.to(device)
    ).loss


@torch.no_grad()
def _report_accuracy(cfg: Config, model: Any, tokenizer: Any, held_out: list[PromptRecord], when: str) -> None:
    """Greedy accuracy on the held-out prompts, judged as `grpo-dist train` judges it."""
    if not held_out:
        return
    model.eval()
    completions = [
        text
        for start in range(0, len(held_out), EVAL_BATCH)
        for text in _greedy(cfg, model, tokenizer, held_out[start : start + EVAL_BATCH])
    ]
    requests = [ScoreRequest(r.text, text, r.fields) for r, text in zip(held_out, completions, strict=True)]
    model.train()
    judge_accuracy(cfg, requests, when)


def _greedy(cfg: Config, model: Any, tokenizer: Any, records: list[PromptRecord]) -> list[str]:
    """Greedy completions of left-padded prompts, up to `rollout.max_new_tokens` tokens, as text."""
    pad_id = tokenizer.pad_token_id or 0
    length = max(len(record.token_ids) for record in records)
    input_ids = torch.tensor([[pad_id] * (length - len(r.token_ids)) + r.token_ids for r in records])  # [B, T]
    attention_mask = torch.tensor([[0] * (length - len(r.token_ids)) + [1] * len(r.token_ids) for r in records])
    device = next(model.parameters()).device
    output = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        max_new_tokens=cfg.rollout.max_new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return tokenizer.batch_decode(output[:, length:], skip_special_tokens=True)
