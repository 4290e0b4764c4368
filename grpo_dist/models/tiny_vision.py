"""Build a tiny random-init vision-language model (Idefics3: a SigLIP-style vision tower, a pixel-shuffle connector
and a Llama text model) with the character tokenizer of `grpo_dist.models.tiny` and the processor that turns a
chat's images into the model's inputs, entirely offline.

The directory is a normal Hugging Face model directory (the model, its tokenizer, `processor_config.json` and a
chat template), so it loads with `AutoModelForImageTextToText` / `AutoProcessor` and with vLLM, whose CPU backend
serves it with images: it exists so that vision-language RL runs for real on a CPU in tests and in the bundled
image task, with nothing downloaded. Idefics3, not Qwen2-VL: vLLM's Qwen2-VL (and LLaVA, Gemma 3, InternVL) import
torchvision, whose CPU build for this torch is not on the package registries this project installs from; Idefics3's
processor and vLLM's model for it need only Pillow.

Choices that matter to callers:

- Each image is resized to `image_size` pixels square and becomes `image_tokens` `<image>` tokens in the prompt,
  between `<fake_token_around_image>` tokens (the processor expands the chat template's one `<image>` per image).
- Both heads (vision and text) are 64 wide: vLLM's CPU attention rejects smaller ones.
- Weights are float32 and depend only on `seed`; the global torch RNG state is left untouched.

Usage from a shell: ``python -m grpo_dist.models.tiny_vision OUT_DIR [--seed 0]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from grpo_dist.models.tiny import CHARACTERS, HEAD_DIM, build_tiny_tokenizer

IMAGE_TOKEN, AROUND_IMAGE, END_OF_UTTERANCE, GLOBAL_IMAGE = (
    "<image>",
    "<fake_token_around_image>",
    "<end_of_utterance>",
    "<global-img>",
)
TILE_TOKENS = tuple(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7))
"""The tokens Idefics3's processor names an image's tiles with (unused here: an image is one tile), which it looks
up in the tokenizer."""

VISION_CHAT_TEMPLATE = (
    "{%- for message in messages -%}<|{{ message['role'] }}|>"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}<image>{%- else -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<eos>{{ '\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
"""`<|role|>content<eos>` and a newline per message, as the text models' template, where a message's content may be
a list of parts: `{"type": "image"}` (one `<image>`, which the processor expands) and `{"type": "text", "text":
...}`."""


def build_tiny_vision_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 256,
    vision_layers: int = 1,
    image_size: int = 56,
    patch_size: int = 14,
    max_position_embeddings: int = 512,
    seed: int = 0,
    characters: str = CHARACTERS,
) -> Path:
    """Write a random-init Idefics3 model, its character tokenizer and its processor to `out_dir`; return it. The
    defaults give about 0.44M parameters and 4 image tokens an image ((56 / 14)^2 patches, merged 2 x 2)."""
    from transformers import GenerationConfig, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    if hidden_size != HEAD_DIM * num_heads:
        raise ValueError(f"build_tiny_vision_model: hidden_size {hidden_size} must be {HEAD_DIM} x num_heads")
    if image_size % (2 * patch_size):
        raise ValueError(f"build_tiny_vision_model: image_size {image_size} must be a multiple of 2 x patch_size")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(model_max_length=max_position_embeddings, characters=characters)
    specials = [AROUND_IMAGE, IMAGE_TOKEN, END_OF_UTTERANCE, GLOBAL_IMAGE, *TILE_TOKENS]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    ids.update(pad_token_id=tokenizer.pad_token_id)
    config = Idefics3Config(
        text_config=dict(
            model_type="llama",
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=True,
            **ids,
        ),
        vision_config=dict(
            hidden_size=HEAD_DIM,
            intermediate_size=2 * HEAD_DIM,
            num_hidden_layers=vision_layers,
            num_attention_heads=1,
            image_size=image_size,
            patch_size=patch_size,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        scale_factor=2,
        tie_word_embeddings=True,
        **ids,
    )
    config.dtype = torch.float32  # written to config.json; vLLM reads it for dtype="auto"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(out_dir, safe_serialization=True)
    edge = {"longest_edge": image_size}
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size=edge, max_image_size=edge)
    tokens = (image_size // patch_size) ** 2 // 4  # the connector merges 2 x 2 patches into one token
    processor = Idefics3Processor(images, tokenizer, image_seq_len=tokens, chat_template=VISION_CHAT_TEMPLATE)
    processor.save_pretrained(out_dir)
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random-init vision-language model (Idefics3).")
    parser.add_argument("out_dir", type=Path, help="directory to write the model into (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    args = parser.parse_args(argv)
    print(build_tiny_vision_model(args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
