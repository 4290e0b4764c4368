"""What the LLM judge reads, and what its reply is worth.

The completion, the prompt and the row's fields are text, never instructions the judge's tokenizer acts on: a
completion that writes `<|im_end|>`, `<eos>` or any other token the tokenizer added must not close its turn or
forge the judge's. So the judge's input is built as token ids. `reward.judge.prompt` is filled with a mark standing
for each value and rendered through the judge's chat template; the rendered text is split at the marks, its own
parts (the template's, with their turn markers) tokenized as usual, and each value tokenized apart with every added
token of the tokenizer, special or not, read as the characters that spell it (`split_special_tokens`). The engine
is handed these ids as they are.

The verdict is the first match of `reward.judge.verdict` in the reply, divided by `reward.judge.scale` and clamped
to [`min_score`, `max_score`]; each verdict clamped is counted.
"""

from __future__ import annotations

import copy
import math
import re
import string
from typing import Any

from tokenizers import AddedToken

from grpo_dist.config import JudgeConfig
from grpo_dist.types import ScoreRequest

_MARK = re.compile("\ue000([0-9]+)\ue001")
"""Where the filled-in template holds its i-th value, in private-use characters. The values are never in the
rendered text, so nothing a completion writes can be read as a mark, nor as a value's end."""


class JudgePrompt:
    """Builds the judge's input (token ids) from a request."""

    def __init__(self, tokenizer: Any, judge: JudgeConfig) -> None:
        self.tokenizer = tokenizer
        self.judge = judge
        self.text_tokenizer = _every_added_token_special(tokenizer)
        self._check_spells_added_tokens_as_text()

    def tokens(self, request: ScoreRequest) -> list[int]:
        """[P] what the judge reads of one completion, within its context: a completion too long for it is cut
        (its start kept), so the template's end and the generation prompt stay."""
        budget, completion = self.judge.max_model_len - self.judge.max_tokens, request.completion
        tokens = self._render(request, completion)
        while len(tokens) > budget and completion:
            completion = completion[: max(0, len(completion) * budget // len(tokens) - 1)]
            tokens = self._render(request, completion)
        return tokens[:budget]

    def text_tokens(self, text: str) -> list[int]:
        """The ids of `text` read as text: no id of an added token (special or not) comes from it."""
        encoded = self.text_tokenizer(text, add_special_tokens=False, split_special_tokens=True)
        return list(encoded["input_ids"])

    def _render(self, request: ScoreRequest, completion: str) -> list[int]:
        fields = {key: value for key, value in request.fields.items() if isinstance(value, str | int | float)}
        fields.update(prompt=request.prompt, completion=completion)
        filling = _Filling()
        text = filling.vformat(self.judge.prompt, (), fields)
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        tokens: list[int] = []
        for at, part in enumerate(_MARK.split(text)):  # the template's text, a value's index, the template's, ...
            if at % 2:
                tokens += self.text_tokens(filling.values[int(part)])
            elif part:
                tokens += self.tokenizer(part, add_special_tokens=False)["input_ids"]
        return tokens

    def _check_spells_added_tokens_as_text(self) -> None:
        added = self.tokenizer.added_tokens_decoder
        contents = [token.content for token in added.values()]
        if not contents:
            return
        encoded = self.text_tokenizer(contents, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        for (token_id, token), ids in zip(added.items(), encoded, strict=True):
            if token_id in ids:
                raise ValueError(
                    f"reward.judge.model: its tokenizer ({type(self.tokenizer).__name__}) reads the text "
                    f"{token.content!r} as its token {token_id}, so a completion could write the judge's turn "
                    "markers; use a judge model with a Hugging Face tokenizer (tokenizer.json) that can split "
                    "special tokens"
                )


class VerdictReader:
    """Reads the judge's verdicts, counting those clamped into [min_score, max_score]."""

    def __init__(self, judge: JudgeConfig) -> None:
        self.judge = judge
        self.pattern = re.compile(judge.verdict)
        self.clamped = 0  # verdicts clamped since `take_clamped` last read it

    def read(self, reply: str) -> tuple[float, str | None]:
        """(score, None) from a reply, or (NaN, why) when it holds no verdict."""
        found = self.pattern.search(reply)
        if found is None:
            return math.nan, f"the judge's reply has no verdict matching reward.judge.verdict: {reply[:120]!r}"
        try:
            score = float(found.group(1) or "") / self.judge.scale
        except ValueError:
            score = math.nan
        if math.isnan(score):
            return math.nan, f"the judge's verdict {found.group(1)!r:.40} is not a number: {reply[:120]!r}"
        clamped = min(max(score, self.judge.min_score), self.judge.max_score)
        if clamped != score:
            self.clamped += 1
        return clamped, None

    def take_clamped(self) -> int:
        """The verdicts clamped since the last call."""
        clamped, self.clamped = self.clamped, 0
        return clamped


class _Filling(string.Formatter):
    """Fills `reward.judge.prompt`, keeping each value (a row's field, the prompt, the completion) in `values` and
    writing a mark in its place; a field the row lacks is left as written."""

    def __init__(self) -> None:
        self.values: list[str] = []

    def get_value(self, key: int | str, args: Any, kwargs: dict[str, Any]) -> Any:
        return kwargs[key] if key in kwargs else _Unfilled("{" + str(key) + "}")

    def format_field(self, value: Any, format_spec: str) -> str:
        if isinstance(value, _Unfilled):
            return str(value)
        self.values.append(format(value, format_spec))
        return f"\ue000{len(self.values) - 1}\ue001"


class _Unfilled(str):
    """A template field the row lacks, written back as it was."""


def _every_added_token_special(tokenizer: Any) -> Any:
    """A copy of `tokenizer` in which every added token is special, so `split_special_tokens` splits them all (it
    leaves the added tokens that are not special, such as `<think>`, whole)."""
    text_tokenizer = copy.deepcopy(tokenizer)
    plain = [token for token in text_tokenizer.added_tokens_decoder.values() if not token.special]
    if plain:
        text_tokenizer.add_tokens([AddedToken(t.content, special=True, normalized=t.normalized) for t in plain])
    return text_tokenizer
