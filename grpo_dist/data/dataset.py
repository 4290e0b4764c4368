"""Prompt datasets: read rows from JSON Lines or Parquet, tokenise prompts, and sample batches of them.

A row is a JSON object (or Parquet record) with a prompt field (``"prompt"`` by default) holding a non-empty
string; every other field (``answer``, ...) travels with the prompt to the reward functions. Problems are reported
with the file and the 1-based line (JSON Lines) or row (Parquet) so a bad dataset can be fixed in one pass.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import xxhash

JSONL_SUFFIXES = (".jsonl", ".json")
"""Read as JSON Lines: one object per line, blank lines skipped (a ``.json`` file is read the same way)."""
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_SUFFIXES = JSONL_SUFFIXES + PARQUET_SUFFIXES


class DatasetError(ValueError):
    """A dataset file is missing, empty or holds a malformed row; the message names the file and line."""


class PromptTokenizer(Protocol):
    """The part of a Hugging Face tokenizer that :func:`encode_prompts` uses."""

    chat_template: str | None

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...

    def __call__(self, text: str, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class PromptRecord:
    """One prompt ready for generation."""

    text: str  # the prompt exactly as sent to the model (after the chat template, if any)
    token_ids: list[int]  # [prompt_len] token ids of `text`; no special tokens beyond what the template wrote
    fields: dict[str, Any] = field(default_factory=dict)  # the row's other fields (e.g. answer) for rewards
    index: int = 0  # 0-based position of the row in the dataset file
    messages: list[dict[str, Any]] | None = None  # the row's chat turns (its system prompt first), when templated
    images: tuple[bytes, ...] = ()  # the prompt's images as PNG bytes, one placeholder each in `token_ids`
    image_sources: tuple[str, ...] = ()  # each image's name: its path, or its place in the row

    @property
    def row(self) -> dict[str, Any]:
        """The row an environment starts from: its turns (`messages`) and its other fields."""
        turns = self.messages if self.messages is not None else [{"role": "user", "content": self.text}]
        return {**self.fields, "messages": turns}


MISSING = object()


def lookup(row: dict[str, Any], path: str) -> Any:
    """The value of column `path` in `row`, or `MISSING`: a column of that exact name, else a dotted path into
    nested objects (`reward_model.ground_truth`: the `ground_truth` of the `reward_model` column)."""
    if path in row:
        return row[path]
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def check_row(row: Any, prompt_field: str, where: str, messages: bool = False) -> dict[str, Any]:
    """`row` if it holds a prompt in `prompt_field` (a non-empty string, or with `messages` a non-empty list of
    `{role, content}` turns); a `DatasetError` naming `where` otherwise."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}; write one object per line.")
    key = "data.fields.messages" if messages else "data.fields.prompt"
    prompt = lookup(row, prompt_field)
    if prompt is MISSING:
        raise DatasetError(
            f"{where}: missing prompt field {prompt_field!r} (fields present: {sorted(row)}); "
            f"add it or set {key} to the column that holds the prompt (a dotted path reaches into a nested one)."
        )
    if messages:
        turns_ok = (
            isinstance(prompt, list)
            and prompt
            and all(
                isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)
                for turn in prompt
            )
        )
        if not turns_ok:
            raise DatasetError(
                f"{where}: {key} column {prompt_field!r} must hold chat turns [{{role, content}}, ...], got "
                f"{str(prompt)[:120]!r}."
            )
        return row
    if not isinstance(prompt, str) or not prompt.strip():
        raise DatasetError(f"{where}: prompt field {prompt_field!r} must be a non-empty string, got {prompt!r}.")
    return row


def _read_jsonl(path: Path, prompt_field: str, messages: bool) -> list[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DatasetError(f"{path}: not UTF-8 text ({error}); JSON Lines files must be UTF-8.") from error
    rows = []
    # split("\n"), not splitlines(): a JSON string may hold a raw U+2028; json.loads ignores a trailing "\r".
    for line_number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise DatasetError(
                f"{where}: invalid JSON ({error.msg} at column {error.colno}); "
                f"the file must be JSON Lines, one complete object per line."
            ) from error
        rows.append(check_row(row, prompt_field, where, messages))
    return rows


def _read_parquet(path: Path, prompt_field: str, messages: bool) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq  # imported here: only Parquet datasets need pyarrow

    try:
        table = pq.read_table(path)
    except Exception as error:  # pyarrow raises several types for unreadable files; report which
        raise DatasetError(f"{path}: cannot read as Parquet ({type(error).__name__}: {error}).") from error
    rows = table.to_pylist()
    return [check_row(row, prompt_field, f"{path}: row {number}", messages) for number, row in enumerate(rows, 1)]


def load_rows(path: str | Path, prompt_field: str = "prompt", messages: bool = False) -> list[dict[str, Any]]:
    """Read every row of a ``.jsonl``/``.json`` (JSON Lines) or ``.parquet`` file and check its prompt field (chat
    turns with ``messages``).

    Raises :class:`DatasetError` for an unsupported suffix (naming the supported ones), a missing or empty file or the
    first malformed row (with its file and 1-based line or row number).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise DatasetError(
            f"{path}: unsupported dataset suffix {suffix or '(none)'!r}; supported: {', '.join(SUPPORTED_SUFFIXES)}."
        )
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found (resolved to {path.resolve()}); check the path.")
    read = _read_parquet if suffix in PARQUET_SUFFIXES else _read_jsonl
    rows = read(path, prompt_field, messages)
    if not rows:
        raise DatasetError(f"{path}: the dataset has no rows; it needs at least one {{{prompt_field!r}: ...}} row.")
    return rows


def prompt_text(
    row: dict[str, Any],
    tokenizer: PromptTokenizer,
    system_prompt: str | None = None,
    chat_template: bool | None = None,
    tools: list[dict] | None = None,
) -> str:
    """The prompt of a row (its `prompt` text or its `messages` turns) exactly as the model reads it: through the
    tokenizer's chat template (`chat_template` true, or null and the tokenizer has one), with `tools` offered, else
    raw text; a system turn `system_prompt` first when given."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_template and not has_template:
        raise DatasetError("data.chat_template is true, but the tokenizer of model.path has no chat template")
    turns = prompt_turns(row, system_prompt)
    if chat_template is False or not has_template:
        if "messages" in row:
            raise DatasetError("data.fields.messages: chat turns need a chat template, and the tokenizer has none")
        return f"{system_prompt}\n\n{row['prompt']}" if system_prompt else row["prompt"]
    return tokenizer.apply_chat_template(turns, tools=tools, add_generation_prompt=True, tokenize=False)


def prompt_turns(row: dict[str, Any], system_prompt: str | None = None) -> list[dict[str, Any]]:
    """A row's chat turns: its `messages`, or its `prompt` as a user turn; a system turn `system_prompt` first."""
    turns = row["messages"] if "messages" in row else [{"role": "user", "content": row["prompt"]}]
    if system_prompt and turns[0]["role"] != "system":
        turns = [{"role": "system", "content": system_prompt}, *turns]
    return turns


def with_images(turns: list[dict[str, Any]], count: int, where: str) -> list[dict[str, Any]]:
    """`turns` with `count` image parts before the text of the first user turn (`{"type": "image"}` each, then
    `{"type": "text", ...}`), where chat templates of vision-language models place a prompt's images."""
    for at, turn in enumerate(turns):
        if turn["role"] == "user":
            parts = [{"type": "image"}] * count + [{"type": "text", "text": turn["content"]}]
            return [*turns[:at], {**turn, "content": parts}, *turns[at + 1 :]]
    raise DatasetError(f"{where}: the row has images but no user turn to show them in")


def encode_prompts(
    rows: Sequence[dict[str, Any]],
    tokenizer: PromptTokenizer,
    max_prompt_tokens: int,
    system_prompt: str | None = None,
    chat_template: bool | None = None,
    tools: list[dict] | None = None,
    processor: Any = None,
) -> tuple[list[PromptRecord], int]:
    """Render each row's prompt (`prompt_text`) and tokenise it. Rows hold `prompt` (text) or `messages` (chat
    turns); their other fields travel with the record to the rewards. With `processor` (a vision-language model's,
    given where `data.fields.images` is set) rows hold `images` (PNG bytes, `grpo_dist.data.sources`): each gets an
    image part in the first user turn, one placeholder in the token ids (the engine expands it), and counts toward
    the length limit as the processor expands it.

    Prompts longer than ``max_prompt_tokens`` are skipped. Returns ``(records, num_skipped)``; raises
    :class:`DatasetError` if every prompt was skipped.
    """
    if max_prompt_tokens < 1:
        raise ValueError(f"encode_prompts: max_prompt_tokens must be >= 1, got {max_prompt_tokens}.")
    records, num_skipped = [], 0
    templated = chat_template is not False and bool(getattr(tokenizer, "chat_template", None))
    for index, row in enumerate(rows):
        images = tuple(row.get("images") or ()) if processor is not None else ()
        shown = row
        if images:  # the turns with an image part each
            shown = {**row, "messages": with_images(prompt_turns(row, system_prompt), len(images), f"row {index}")}
        text = prompt_text(shown, tokenizer, system_prompt, chat_template, tools)
        if processor is not None and (found := text.count(processor.image_token)) != len(images):
            raise DatasetError(
                f"row {index} (0-based): its prompt holds {found} image placeholders ({processor.image_token!r}) for"
                f" {len(images)} images: the chat template places one per image, so the prompt's text must hold none"
            )
        token_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if expanded_length(processor, text, images, token_ids) > max_prompt_tokens:
            num_skipped += 1
            continue
        taken = ("prompt", "messages", "images", "image_sources") if processor is not None else ("prompt", "messages")
        fields = {key: value for key, value in row.items() if key not in taken}
        turns = prompt_turns(row, system_prompt) if templated else None
        sources = tuple(row.get("image_sources") or ()) if images else ()
        records.append(PromptRecord(text, token_ids, fields, index, turns, images=images, image_sources=sources))
    if not records:
        raise DatasetError(
            f"encode_prompts: all {num_skipped} prompts are longer than max_prompt_tokens={max_prompt_tokens} "
            f"tokens (after the chat template); raise max_prompt_tokens or shorten the prompts."
        )
    return records, num_skipped


def expanded_length(processor: Any, text: str, images: tuple[bytes, ...], token_ids: list[int]) -> int:
    """How many tokens the model reads of a prompt: its token ids, each image placeholder expanded to the image's
    tokens as `processor` expands it (nothing to expand without images)."""
    if not images:
        return len(token_ids)
    from grpo_dist.models.vision import model_inputs

    return len(model_inputs(processor, text, images)[0])


class PromptSampler:
    """Endless batches of prompts: each epoch is a fresh shuffle, a pure function of ``(seed, epoch)``.

    Batches always hold ``batch_size`` records; the last batch of an epoch is completed from the next epoch's
    shuffle, so a record can appear twice in a batch only when ``batch_size`` exceeds the dataset size.
    ``epoch`` is the epoch the next record will come from. ``state_dict``/``load_state_dict`` resume exactly.
    """

    def __init__(self, records: Sequence[PromptRecord], batch_size: int, seed: int) -> None:
        if not records:
            raise ValueError("PromptSampler: no records to sample from; check the dataset and max_prompt_tokens.")
        if batch_size < 1:
            raise ValueError(f"PromptSampler: batch_size must be >= 1, got {batch_size}.")
        self.records = list(records)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self._position = 0  # index into the current epoch's order of the next record
        self._order = self._shuffled_order(self.epoch)
        self._fingerprint: str | None = None

    def _shuffled_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def _next_record(self) -> PromptRecord:
        if self._position == len(self._order):
            self.epoch += 1
            self._position = 0
            self._order = self._shuffled_order(self.epoch)
        record = self.records[self._order[self._position]]
        self._position += 1
        return record

    def __iter__(self) -> Iterator[list[PromptRecord]]:
        return self

    def __next__(self) -> list[PromptRecord]:
        return self.draw(self.batch_size)

    def draw(self, count: int) -> list[PromptRecord]:
        """The next `count` records."""
        return [self._next_record() for _ in range(count)]

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from, and the fingerprint of the records it is a position in (`data`)."""
        return {"epoch": self.epoch, "position": self._position, "data": self.fingerprint()}

    def fingerprint(self) -> str:
        """A checksum of the records in order (their tokens and fields): a resume over other data would draw other
        prompts. Computed once: the records are the sampler's own, never changed (a step's state carries it)."""
        if self._fingerprint is None:
            digest = xxhash.xxh3_64()
            for record in self.records:
                digest.update(json.dumps([record.token_ids, record.fields], sort_keys=True, default=str).encode())
                for image in record.images:  # (text prompts' fingerprints are as before)
                    digest.update(image)
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self._position = int(state["epoch"]), int(state["position"])
        self._order = self._shuffled_order(self.epoch)
