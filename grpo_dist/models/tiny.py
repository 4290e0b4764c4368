"""Build a tiny random-init Qwen2 causal LM with a character-level tokenizer, entirely offline.

The directory written by :func:`build_tiny_model` is a normal Hugging Face model directory (``config.json``,
``model.safetensors``, ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``), so it loads with
``AutoModelForCausalLM`` / ``AutoTokenizer`` and with vLLM. It exists so the whole GRPO loop (Ray, vLLM, DeepSpeed)
can run for real on a CPU in tests and in the bundled toy tasks, with nothing downloaded from a model hub.

Choices that matter to callers:

- One token per character of printable ASCII (see :data:`CHARACTERS`), so ``decode(encode(s)) == s`` for any
  ASCII string, spaces, tabs and newlines included. Characters outside it (``"é"``) are dropped on encode: the
  tokenizer is a byte-level BPE with no merges and, like every ``Qwen2Tokenizer``, no unknown token.
- ``vocab_size`` in the config equals the tokenizer's vocabulary size exactly (no padding), so the model can
  never sample an id the tokenizer cannot decode.
- ``head_dim`` is fixed at 64 (``hidden_size == 64 * num_heads``): vLLM's CPU attention backend rejects smaller
  head sizes such as 16.
- Weights are float32 and depend only on ``seed``; the global torch RNG state is left untouched.
- ``weights=False`` writes the tokenizer and ``config.json`` alone, importing neither torch nor transformers' model
  classes (most of a dry run's time, docs/performance.md): what `grpo-dist check` and `plan` read of a model they
  throw away.

Usage from a shell: ``python -m grpo_dist.models.tiny OUT_DIR [--seed 0]``.
"""

from __future__ import annotations

import argparse
import json
import string
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import pre_tokenizers
from transformers import Qwen2Tokenizer

if TYPE_CHECKING:  # torch and the model classes: imported where weights are built (`_random_init_model`)
    from transformers import Qwen2Config, Qwen2ForCausalLM

HEAD_DIM = 64
"""Attention head size; vLLM's CPU attention backend needs 64 or more (it rejects 16)."""

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
"""Special tokens, in id order: ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3."""

CHARACTERS = string.digits + string.ascii_lowercase + string.ascii_uppercase + string.punctuation + " \n\t"
"""Every ordinary token: one per printable ASCII character (97), ids 4 to 100 in this order."""

CHAT_TEMPLATE = (
    "{%- if tools -%}<|tools|>{{ tools | map(attribute='function.name') | join(',') }}<eos>{{ '\\n' }}{%- endif -%}"
    "{%- for message in messages -%}<|{{ message['role'] }}|>{{ message['content'] }}<eos>{{ '\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
"""The chat template of `model.tiny.chat_template`: `<|role|>content<eos>` and a newline per message (the model's
turn ends at `<eos>`, where generation stops), the offered tools' names first; all in the tokenizer's characters."""


def _byte_level_symbol(character: str) -> str:
    """The printable stand-in byte-level BPE uses for a one-byte character (" " -> "Ġ", "\\n" -> "Ċ")."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    ((symbol, _),) = byte_level.pre_tokenize_str(character)
    return symbol


def build_tiny_tokenizer(
    chat_template: str | None = None, model_max_length: int = 256, characters: str = CHARACTERS
) -> Qwen2Tokenizer:
    """Return a tokenizer with one token per character of ``characters`` (printable ASCII by default).

    It is a Qwen2 byte-level BPE tokenizer with an empty merge list, so every character stays its own token.
    Built this way, not as a ``WordLevel`` model, because transformers 5 loads any ``model_type="qwen2"``
    directory with ``Qwen2Tokenizer``, which rebuilds the byte-level pipeline around the saved vocabulary: a
    tokenizer of any other shape would be silently replaced on load (by ``AutoTokenizer`` and by vLLM).
    """
    _check_characters(characters)
    symbols = [_byte_level_symbol(character) for character in characters]
    vocab = {token: token_id for token_id, token in enumerate(SPECIAL_TOKENS + tuple(symbols))}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,  # would turn " ." into "." on decode
        model_max_length=model_max_length,
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _check_characters(characters: str) -> None:
    outside = sorted(set(characters) - set(CHARACTERS))
    if outside or len(set(characters)) != len(characters) or not characters:
        raise ValueError(
            f"characters must be distinct printable ASCII characters, got {characters!r}"
            + (f" (not printable ASCII: {outside})" if outside else "")
        )


def _check_sizes(hidden_size: int, num_heads: int) -> None:
    if num_heads >= 1 and hidden_size == HEAD_DIM * num_heads:
        return
    fixes = [f"hidden_size={HEAD_DIM * max(1, num_heads)}"]
    if hidden_size % HEAD_DIM == 0 and hidden_size > 0:
        fixes.append(f"num_heads={hidden_size // HEAD_DIM}")
    raise ValueError(
        f"build_tiny_model: hidden_size={hidden_size} with num_heads={num_heads} does not give head_dim {HEAD_DIM} "
        f"(vLLM's CPU attention rejects smaller heads); pass {' or '.join(fixes)}."
    )


def _tiny_config_fields(tokenizer: Qwen2Tokenizer, **sizes: int) -> dict:
    """The `Qwen2Config` settings of a tiny model (the rest are Qwen2's defaults)."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=sizes["hidden_size"],
        intermediate_size=sizes["intermediate_size"],
        num_hidden_layers=sizes["num_layers"],
        num_attention_heads=sizes["num_heads"],
        num_key_value_heads=sizes["num_heads"],
        max_position_embeddings=sizes["max_position_embeddings"],
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _tiny_config(fields: dict) -> Qwen2Config:
    import torch
    from transformers import Qwen2Config

    config = Qwen2Config(**fields)
    config.dtype = torch.float32  # written to config.json; vLLM reads it for dtype="auto"
    return config


def _random_init_model(config: Qwen2Config, seed: int, num_labels: int | None = None) -> Qwen2ForCausalLM:
    """Initialise the weights from ``seed`` alone, leaving the caller's global RNG state as it was: a causal LM, or
    with ``num_labels`` a sequence classifier."""
    import torch
    from transformers import Qwen2ForCausalLM, Qwen2ForSequenceClassification

    if num_labels is not None:
        config.num_labels = num_labels
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config) if num_labels is None else Qwen2ForSequenceClassification(config)
    return model.to(torch.float32).eval()


def build_tiny_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 256,
    seed: int = 0,
    chat_template: str | None = None,
    characters: str = CHARACTERS,
    num_labels: int | None = None,
    weights: bool = True,
) -> Path:
    """Write a random-init Qwen2 model and its character tokenizer to ``out_dir``; return the directory. With
    ``num_labels`` the model is a sequence classifier of that many labels (`build_tiny_reward_model`). Without
    ``weights``, only the tokenizer and ``config.json`` (the settings a build with weights writes, the rest left to
    Qwen2's defaults as it does), for a dry run: torch is not imported.

    The defaults give about 0.34M parameters. The same arguments always produce the same weights.
    ``chat_template`` (a Jinja string) is stored on the tokenizer so ``apply_chat_template`` works.
    ``characters`` narrows the vocabulary (e.g. ``"0123456789 :"`` for a digits-only task): a small vocabulary
    makes a random-init model's first samples far more often well-formed.
    """
    _check_sizes(hidden_size, num_heads)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(chat_template, model_max_length=max_position_embeddings, characters=characters)
    sizes = dict(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads)
    sizes.update(intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings)
    fields = _tiny_config_fields(tokenizer, **sizes)
    if not weights:
        if num_labels is not None:
            raise ValueError("build_tiny_model: a sequence classifier (num_labels) is built with its weights")
        architecture = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "dtype": "float32"}
        (out_dir / "config.json").write_text(json.dumps({**architecture, **fields}, indent=2) + "\n")
        tokenizer.save_pretrained(out_dir)
        return out_dir
    from transformers import GenerationConfig

    model = _random_init_model(_tiny_config(fields), seed, num_labels)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def build_tiny_reward_model(out_dir: str | Path, **settings) -> Path:
    """Write a random-init Qwen2 sequence classifier with one label (a reward model: its logit is the score) and
    its character tokenizer to `out_dir` (`build_tiny_model`'s `settings`); return the directory. Its pad token is
    set in its config, so that it scores batches."""
    return build_tiny_model(out_dir, num_labels=1, **settings)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random-init Qwen2 model with a character tokenizer.")
    parser.add_argument("out_dir", type=Path, help="directory to write the model into (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    args = parser.parse_args(argv)
    print(build_tiny_model(args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
