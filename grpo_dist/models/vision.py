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


def placeholders(processor, text: str) -> int:
    """How many images a rendered prompt has room for (its image placeholders)."""
    return text.count(processor.image_token)
