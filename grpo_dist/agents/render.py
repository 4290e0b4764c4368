"""The chat template's tokens of a conversation, built so that what the model generated is never re-tokenized.

A trajectory's tokens are the first messages rendered by the chat template (with the tools' schemas), then each
model turn exactly as sampled (its end-of-turn token included), then each observation's tokens, then the next turn.
An observation's tokens are what the template writes for its messages after an assistant turn, found by rendering a
fixed two-message conversation with and without them and taking the difference; the template's own text after the
assistant's end-of-turn token (ChatML's newline) opens the observation. So the decoded trajectory is the template's
rendering of the whole conversation, and every token the model sampled is trained as it was sampled.
"""

from __future__ import annotations

from typing import Any

PROBE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
"""The conversation an observation's rendering is measured after."""


class TemplateError(ValueError):
    """A chat template whose rendering of an observation does not extend the conversation before it."""


class Renderer:
    """Renders first messages and observations for one tokenizer (its chat template), with `tools` (the chat
    template's tool entries) offered."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("an environment needs a chat template, and the tokenizer of model.path has none")
        self.tokenizer, self.tools = tokenizer, tools or None
        self.end_of_turn = tokenizer.decode([tokenizer.eos_token_id])
        self.before = self._text(PROBE, generation_prompt=False)  # what every observation is measured after
        tail = self.before[self.before.rindex(PROBE[1]["content"]) + 1 :]
        if not tail.startswith(self.end_of_turn):
            raise TemplateError(
                f"the chat template ends an assistant turn with {tail!r}, not with the end-of-sequence token "
                f"{self.end_of_turn!r} at which generation stops"
            )
        self.after_turn = tail[len(self.end_of_turn) :]  # the template's text after the end-of-turn token

    def _text(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=generation_prompt, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def first(self, messages: list[dict[str, Any]]) -> list[int]:
        """[P] the first messages and the assistant's generation prompt, as the driver renders a prompt."""
        return self.encode(self._text(messages, generation_prompt=True))

    def observation(self, messages: list[dict[str, Any]]) -> list[int]:
        """[O] the tokens after a model turn's end-of-turn token: the observation messages and the next
        generation prompt."""
        before, after = self.before, self._text(PROBE + messages, generation_prompt=True)
        if not after.startswith(before):
            raise TemplateError(
                "the chat template renders a conversation differently once observation messages follow it (it "
                f"rewrites earlier turns): {before!r} is not a prefix of {after!r}"
            )
        return self.encode(self.after_turn + after[len(before) :])

    def turn(self, text: str) -> list[int]:
        """[T] an assistant turn written out (a transcript's), its end-of-turn token last."""
        return self.encode(text) + [self.tokenizer.eos_token_id]
