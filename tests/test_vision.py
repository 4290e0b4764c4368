"""Vision-language models, up to the engine: a row's images read from where a dataset keeps them, the tiny
Idefics3 model's processor putting each image's tokens in its prompt, and vLLM's CPU backend serving the model with
the images, its sampling log-probs those of the model's own forward on the processor's pixels (and not those it
gives another image)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from grpo_dist.models.tiny_vision import AROUND_IMAGE, GLOBAL_IMAGE, IMAGE_TOKEN, build_tiny_vision_model
from grpo_dist.models.vision import ImageError, encoded, model_inputs, opened

RED, BLUE = (220, 30, 30), (30, 30, 220)
QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "color?"}]}]


def png(color: tuple[int, int, int], size: int = 40) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (size, size), color).save(out, format="PNG")
    return out.getvalue()


def test_a_rows_image_is_read_from_a_path_a_file_url_bytes_or_a_datasets_value_and_else_refused(tmp_path):
    picture = tmp_path / "pictures" / "red.png"
    picture.parent.mkdir()
    picture.write_bytes(png(RED))
    Image.new("L", (8, 8), 128).save(tmp_path / "grey.jpg")
    forms = [
        str(picture),
        "pictures/red.png",  # relative to the dataset's folder
        f"file://{picture}",
        png(RED),
        {"bytes": None, "path": str(picture)},  # a `datasets` Image column's value
        {"bytes": png(RED), "path": "elsewhere.png"},
        Image.open(picture),
    ]
    read = [opened([encoded(form, "row 0, images", tmp_path)])[0] for form in forms]
    assert all(image.size == (40, 40) and image.getpixel((3, 3)) == RED for image in read)
    (grey,) = opened([encoded(str(tmp_path / "grey.jpg"), "row 1, images")])
    assert grey.mode == "RGB" and grey.getpixel((0, 0)) == (128, 128, 128)  # every image reaches the model as RGB

    refused = {
        "https://example.com/a.png": "row 2, images: 'https://example.com/a.png' is a URL; only local files",
        str(tmp_path / "missing.png"): "row 2, images: cannot read the image",
        b"not an image": "row 2, images: cannot read the image",
        3: "row 2, images: an image must be a path, bytes or an image, got int",
    }
    for value, said in refused.items():
        with pytest.raises(ImageError, match="^" + said.replace("(", r"\(").replace("?", r"\?")):
            encoded(value, "row 2, images")


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory) -> Path:
    return build_tiny_vision_model(tmp_path_factory.mktemp("vision") / "model")


def test_the_tiny_vision_models_processor_gives_each_image_its_tokens_and_its_forward_reads_the_pixels(vision_model):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(vision_model)
    text = processor.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert text.count(IMAGE_TOKEN) == 1 and text.endswith("color?<eos>\n<|assistant|>")
    red_ids, red = model_inputs(processor, text, [png(RED)])
    blue_ids, blue = model_inputs(processor, text, [png(BLUE)])
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert red_ids == blue_ids and red_ids.count(image_id) == 4  # (56 / 14)^2 patches, merged 2 x 2
    placeholder = processor.tokenizer(text)["input_ids"]
    at = placeholder.index(image_id)
    expanded = processor.tokenizer.convert_ids_to_tokens(red_ids[at : at + 7])
    assert expanded == [AROUND_IMAGE, GLOBAL_IMAGE, *[IMAGE_TOKEN] * 4, AROUND_IMAGE]
    assert red_ids[:at] == placeholder[:at] and red_ids[at + 7 :] == placeholder[at + 1 :]
    assert red["pixel_values"].shape == (1, 1, 3, 56, 56) and not torch.equal(red["pixel_values"], blue["pixel_values"])

    model = AutoModelForImageTextToText.from_pretrained(vision_model, dtype=torch.float32).eval()
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    with torch.no_grad():
        on_red = model(input_ids=torch.tensor([red_ids]), **red).logits[0, -1]
        on_blue = model(input_ids=torch.tensor([blue_ids]), **blue).logits[0, -1]
    assert (on_red - on_blue).abs().max() > 1e-3  # the answer's distribution depends on the image


@pytest.mark.slow
def test_the_engine_serves_a_prompts_images_with_the_models_own_log_probs(ray_cluster, vision_model):
    """vLLM's CPU backend given a prompt (one image placeholder) and its image: the prompt it samples from holds the
    image's tokens as the processor puts them, and each sampled token's log-prob is the model's own forward's on
    the processor's pixels of that image, not of the other."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from grpo_dist.cluster.actors.generator import Generator
    from grpo_dist.config.sections import RolloutConfig

    processor = AutoProcessor.from_pretrained(vision_model)
    model = AutoModelForImageTextToText.from_pretrained(vision_model, dtype=torch.float32).eval()
    text = processor.apply_chat_template(QUESTION, add_generation_prompt=True)
    prompt = processor.tokenizer(text)["input_ids"]
    rollout = RolloutConfig(max_new_tokens=4, max_model_len=64, cpu_kv_cache_gib=0.05)
    generator = ray_cluster.remote(Generator).options(num_cpus=1).remote(str(vision_model), rollout, 0)
    try:
        ray_cluster.get(generator.start.remote(), timeout=300)
        images = {"red": png(RED), "blue": png(BLUE)}
        groups = {name: ray_cluster.get(generator.generate.remote(prompt, 4, None, 0, 7, None, [image]), timeout=300)
                  for name, image in images.items()}  # fmt: skip
    finally:
        ray_cluster.kill(generator)

    def forward(completion, image: bytes) -> list[float]:
        ids, tensors = model_inputs(processor, text, [image])
        assert completion.prompt_token_ids == ids  # the engine expanded the placeholder as the processor does
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + completion.token_ids]), **tensors).logits[0]
        logprobs = torch.log_softmax(logits[len(ids) - 1 : -1], dim=-1)
        return [logprobs[at, token].item() for at, token in enumerate(completion.token_ids)]

    for name, group in groups.items():
        other = images["blue" if name == "red" else "red"]
        assert len(group) == 4 and all(len(c.token_ids) == 4 for c in group)
        gaps = [max(abs(a - b) for a, b in zip(forward(c, images[name]), c.logprobs, strict=True)) for c in group]
        elsewhere = [max(abs(a - b) for a, b in zip(forward(c, other), c.logprobs, strict=True)) for c in group]
        print(f"{name}: largest gap to the forward on its image {max(gaps):.2e}, on the other {max(elsewhere):.2e}")
        assert max(gaps) < 1e-4 and min(elsewhere) > 1e-3, (gaps, elsewhere)
