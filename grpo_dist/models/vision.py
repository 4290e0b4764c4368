"""A prompt's images, as they travel and as each role reads them: encoded once as PNG bytes (what crosses actor
boundaries: a few kilobytes an image, the same bytes to every reader), opened as RGB images where a model needs
them, and turned into the model's inputs by its processor (the prompt's token ids with each image's tokens in
place, and the tensors its vision tower reads: pixel values and their mask). The engine takes the prompt with one
placeholder per image and expands it itself, as the processor does; what the learner reads of the same images is
`model_inputs`, the processor's pixels, which are the engine's too."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

IMAGE_TENSORS = ("pixel_values", "pixel_attention_mask", "image_grid_thw", "image_sizes")
"""The processor outputs a vision-language model's forward takes beside the token ids (those a processor gives)."""


class ImageError(ValueError):
    """An image that cannot be read, named with where it came from."""


def encoded(image: Any, where: str, base_dir: Path | None = None) -> bytes:
    """One image of a dataset row as PNG bytes: a path (relative to `base_dir`) or `file://` URL, bytes of an
    image file, a `datasets` Image value (`{"bytes": ..., "path": ...}`) or a PIL image. `where` names it in an
    error (`ImageError`): the row and field."""
    from PIL import Image

    if isinstance(image, dict):  # a `datasets` Image column's value
        image = image.get("bytes") or image.get("path")
    try:
        if isinstance(image, Image.Image):
            picture = image
        elif isinstance(image, bytes | bytearray):
            picture = Image.open(io.BytesIO(image))
        elif isinstance(image, str | Path):
            text = str(image)
            if "://" in text and not text.startswith("file://"):
                raise ImageError(f"{where}: {text!r} is a URL; only local files (a path or file://) are read")
            path = Path(text.removeprefix("file://"))
            picture = Image.open(path if path.is_absolute() or base_dir is None else base_dir / path)
        else:
            raise ImageError(f"{where}: an image must be a path, bytes or an image, got {type(image).__name__}")
        picture.load()
    except ImageError:
        raise
    except (OSError, ValueError) as err:
        raise ImageError(f"{where}: cannot read the image ({err})") from err
    out = io.BytesIO()
    picture.convert("RGB").save(out, format="PNG")
    return out.getvalue()


def source_name(image: Any, where: str) -> str:
    """What an image of a dataset row is called where it is shown: its path (a `datasets` value's too), else
    `where` (its column and place in the row)."""
    if isinstance(image, dict):
        image = image.get("path") or where
    return str(image) if isinstance(image, str | Path) else where


def opened(images: Sequence[bytes]) -> list:
    """PNG bytes (`encoded`) as RGB PIL images."""
    from PIL import Image

    return [Image.open(io.BytesIO(data)).convert("RGB") for data in images]


def model_inputs(processor, text: str, images: Sequence[bytes]) -> tuple[list[int], dict]:
    """A rendered prompt (its chat template's text, one image placeholder per image) and its images through the
    model's processor: the token ids, each image expanded to its tokens, and the vision tensors (`IMAGE_TENSORS`
    the processor gives, batch dimension 1)."""
    found = processor(text=[text], images=[opened(images)], return_tensors="pt")
    ids = found["input_ids"][0].tolist()
    return ids, {name: found[name] for name in IMAGE_TENSORS if name in found}


def describe(image: bytes, name: str) -> str:
    """An image (`encoded`) as a check names it: its name (`source_name`), its size and a digest of its pixels."""
    import hashlib

    (picture,) = opened([image])
    return f"{name} ({picture.width}x{picture.height}, {hashlib.sha256(picture.tobytes()).hexdigest()[:8]})"


SUPPORTED = ("idefics3", "smolvlm", "qwen2_vl", "qwen2_5_vl")
"""The vision-language model types whose processors' pixel layouts `batch_pixels` combines: batched images with a
mask (Idefics3, SmolVLM), or flat patches with an image grid (Qwen2-VL, Qwen2.5-VL)."""


def model_config(model_path: str | Path) -> dict:
    """The model's config.json at `model_path` as a dict (empty where there is none or it is not JSON)."""
    import json

    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def model_type(model_path: str | Path) -> str | None:
    """The `model_type` of the model at `model_path` (None where its config names none)."""
    return model_config(model_path).get("model_type")


def is_vision_model(model_path: str | Path) -> bool:
    """Whether the model at `model_path` is a vision-language model (its config.json has a vision tower)."""
    return "vision_config" in model_config(model_path)


def load_policy(model_path: str | Path, dtype):
    """The model at `model_path` as a Hugging Face model whose forward gives next-token logits: a causal LM, or a
    vision-language model (which also takes `IMAGE_TENSORS`)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    kind = AutoModelForImageTextToText if is_vision_model(model_path) else AutoModelForCausalLM
    return kind.from_pretrained(model_path, dtype=dtype)


def row_pixels(image_processor, images: Sequence[bytes]) -> dict:
    """The tensors a vision-language model's forward reads of one row's images (batch dimension 1, or the images'
    patches in one flat tensor where the model takes them so: `image_grid_thw`); empty without images."""
    if not images:
        return {}
    found = image_processor(images=[opened(images)], return_tensors="pt")
    return {name: found[name] for name in IMAGE_TENSORS if name in found}


def batch_pixels(rows: Sequence[dict]) -> dict:
    """Rows' `row_pixels` as one micro-batch's: flat patches concatenated in row order (the order of the image
    tokens in the batch: `image_grid_thw`), or batched tensors [1, images, ..., H, W] stacked, each row padded to the
    most images with all-zero images (which such models skip) and each image to the largest height and width (its
    mask false there); empty where no row has images."""
    import torch
    import torch.nn.functional as F

    found = [row for row in rows if row]
    if not found:
        return {}
    if "image_grid_thw" in found[0]:
        return {name: torch.cat([row[name] for row in found]) for name in found[0]}
    most = max(row["pixel_values"].shape[1] for row in found)
    height = max(row["pixel_values"].shape[-2] for row in found)
    width = max(row["pixel_values"].shape[-1] for row in found)
    out = {}
    for name, like in found[0].items():
        padded = []
        for row in rows:
            have = row[name] if row else like[:, :0]
            have = F.pad(have, (0, width - have.shape[-1], 0, height - have.shape[-2]))  # zeros: false in a mask
            padded.append(torch.cat([have, have.new_zeros((1, most - have.shape[1], *have.shape[2:]))], dim=1))
        out[name] = torch.cat(padded)
    return out


PLACEHOLDER_KEYS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
"""Where a vision-language model's config.json names the tokens its prompts hold in place of an image's features."""


def placeholder_ids(model_path: str | Path) -> list[int]:
    """The token ids that stand for an image's (or a video's) features in a vision-language model's prompts; empty
    for a text model. A completion may not sample one: the learner's forward would take it for a slot to fill with
    image features the prompt does not have. The engines bias them away and the learner scores them out, so both
    sample from and score the same distribution (the vocabulary without them: `grpo_dist.algo.scoring.without`)."""
    config = model_config(model_path)
    if "vision_config" not in config:
        return []
    return sorted({config[key] for key in PLACEHOLDER_KEYS if isinstance(config.get(key), int)})


def served_image_key(image: bytes, served: str) -> str:
    """The key an engine caches an image's vision-tower output under: the image's digest and `served`, the key of
    the weights it serves (the generator's cache salt, which each weight version changes). vLLM keys that cache by
    the image alone, so without the version a picture seen again after a weight update is read with the old tower
    (a run's learner and engine log-probs drifted apart from the second epoch of its pictures on, 3e-2 by its third
    step there)."""
    import hashlib

    return f"{hashlib.sha256(image).hexdigest()}@{served}"
