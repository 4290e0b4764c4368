"""A reward-model actor: a frozen sequence classifier (`reward.model`) scoring completions in batches, each read
through the reward model's own tokenizer and chat template (the conversation's turns and the completion as the
assistant's), never the policy's."""

from __future__ import annotations

import math

from grpo_dist.config import RewardModelConfig
from grpo_dist.sandbox.privileges import die_with_parent


class Classifier:
    def __init__(self, model_path: str, settings: RewardModelConfig) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        die_with_parent()
        self.settings = settings
        self.device = torch.device("cuda" if torch.cuda.is_available() and settings.num_gpus > 0 else "cpu")
        on_cpu = self.device.type == "cpu"
        dtype = torch.float32 if on_cpu else getattr(torch, "bfloat16" if settings.dtype == "auto" else settings.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForSequenceClassification.from_pretrained(model_path, dtype=dtype).to(self.device)
        self.model.eval().requires_grad_(False)
        positions = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        self.max_length = settings.length(positions)
        labels = self.model.config.num_labels
        if settings.label >= labels:
            raise ValueError(f"reward.model.label: {settings.label}, and {model_path} has {labels} label(s)")
        text = self.model.config.get_text_config()
        if text.pad_token_id is None:  # the model finds each row's last token by it
            if self.tokenizer.pad_token_id is None:
                raise ValueError(f"reward.model.path: {model_path} has no pad token to batch its inputs with")
            self.model.config.pad_token_id = text.pad_token_id = self.tokenizer.pad_token_id

    def tokens(self, turns: list[dict] | None, prompt: str, completion: str) -> tuple[list[int], bool]:
        """What the model reads of one completion, and whether it was cut (`reward_model_tokens`)."""
        return reward_model_tokens(self.tokenizer, self.max_length, turns, prompt, completion)

    def score(self, items: list[tuple[list[dict] | None, str, str]]) -> list[tuple[float, bool]]:
        """The score of each (turns, prompt, completion), in order (the `label` logit, normalized and scaled), and
        whether its input was cut to `max_length`."""
        import torch

        inputs, cut = zip(*(self.tokens(*item) for item in items), strict=True) if items else ((), ())
        pad = self.model.config.get_text_config().pad_token_id
        scores: list[float] = []
        for start in range(0, len(inputs), self.settings.batch_size):
            batch = inputs[start : start + self.settings.batch_size]
            width = max(len(ids) for ids in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, each in enumerate(batch):  # right padding: the model scores each row's last real token
                ids[row, : len(each)] = torch.tensor(each)
                mask[row, : len(each)] = 1
            with torch.no_grad():
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            scores += [self._normalized(value) for value in logits[:, self.settings.label].float().tolist()]
        return list(zip(scores, cut, strict=True))

    def _normalized(self, logit: float) -> float:
        if not math.isfinite(logit):  # the model's failure (an overflow): left for the pool to leave unscored
            return logit
        if self.settings.normalize == "sigmoid":
            logit = 1.0 / (1.0 + math.exp(-logit)) if logit >= -700 else 0.0
        return logit * self.settings.scale


def reward_model_tokens(
    tokenizer, max_length: int, turns: list[dict] | None, prompt: str, completion: str
) -> tuple[list[int], bool]:
    """What a reward model reads of one completion: through its chat template, the prompt's turns (the policy's
    prompt as one user turn where the row had none) and the completion as the assistant's; without a template,
    the policy's prompt text and the completion. A template writes the special tokens it wants; raw text gets the
    tokenizer's. Cut to `max_length` keeping both ends; and whether it was."""
    templated = bool(getattr(tokenizer, "chat_template", None))
    if templated:
        answer = {"role": "assistant", "content": completion}
        conversation = [*(turns or [{"role": "user", "content": prompt}]), answer]
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    else:
        text = prompt + completion
    ids = list(tokenizer(text, add_special_tokens=not templated)["input_ids"])
    if len(ids) <= max_length:
        return ids, False
    return ids[: max_length // 2] + ids[len(ids) - (max_length - max_length // 2) :], True
