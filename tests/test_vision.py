"""Vision-language models, up to the engine: a row's images read from where a dataset keeps them, the tiny
Idefics3 model's processor putting each image's tokens in its prompt, and vLLM's CPU backend serving the model with
the images, its sampling log-probs those of the model's own forward on the processor's pixels (and not those it
gives another image)."""

from __future__ import annotations

import io
import json
import re
import statistics
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from grpo_dist.algo.scoring import without
from grpo_dist.models.tiny_vision import AROUND_IMAGE, GLOBAL_IMAGE, IMAGE_TOKEN, build_tiny_vision_model
from grpo_dist.models.vision import ImageError, encoded, model_inputs, opened, placeholder_ids

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

    banned = torch.tensor(placeholder_ids(vision_model))
    assert banned.tolist() == [processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)]

    def forward(completion, image: bytes, scored_out: torch.Tensor | None = banned) -> list[float]:
        ids, tensors = model_inputs(processor, text, [image])
        assert completion.prompt_token_ids == ids  # the engine expanded the placeholder as the processor does
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + completion.token_ids]), **tensors).logits[0]
        logprobs = torch.log_softmax(without(logits[len(ids) - 1 : -1], scored_out), dim=-1)  # as the learner
        return [logprobs[at, token].item() for at, token in enumerate(completion.token_ids)]

    def gap(completion, image: bytes, scored_out: torch.Tensor | None = banned) -> float:
        return max(abs(a - b) for a, b in zip(forward(completion, image, scored_out), completion.logprobs, strict=True))

    for name, group in groups.items():
        other = images["blue" if name == "red" else "red"]
        assert len(group) == 4 and all(len(c.token_ids) == 4 for c in group)
        assert not any(set(c.token_ids) & set(banned.tolist()) for c in group)
        gaps, elsewhere = [gap(c, images[name]) for c in group], [gap(c, other) for c in group]
        whole = [gap(c, images[name], None) for c in group]  # the placeholder's share of the vocabulary left in
        print(f"{name}: largest gap to the forward on its image {max(gaps):.2e}, on the other {max(elsewhere):.2e},"
              f" with the placeholder left in {min(whole):.2e}")  # fmt: skip
        assert max(gaps) < 1e-4 and min(elsewhere) > 1e-3 and min(whole) > 1e-3, (gaps, elsewhere, whole)


def test_the_color_tasks_rows_carry_their_pictures_and_their_prompts_one_placeholder_each(tmp_path, vision_model):
    """A bundled image task as a run reads it: each row's picture drawn beside the JSON Lines file, read back as the
    image its answer names, one placeholder in the prompt's token ids and the expanded prompt counted for the
    length limit; no picture in the fields the rewards get."""
    from transformers import AutoProcessor

    from grpo_dist.config.sections import FieldsConfig
    from grpo_dist.data import encode_prompts, split_task
    from grpo_dist.data.sources import read_source
    from grpo_dist.data.tasks import COLORS

    train_path, eval_path = split_task("color", tmp_path / "data", num_train=24, num_eval=6, seed=0)
    assert len(list((tmp_path / "data" / "images").glob("*.png"))) == 30
    rows = read_source(str(train_path), "train", None, FieldsConfig(images="images"), "data.path")
    processor = AutoProcessor.from_pretrained(vision_model)
    records, skipped = encode_prompts(rows, processor.tokenizer, 48, processor=processor)
    assert skipped == 0 and len(records) == 24
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    for record in records:
        (picture,) = opened(record.images)
        drawn = {color for _, color in picture.getcolors()}
        assert picture.size == (56, 56) and drawn & set(COLORS.values()) == {COLORS[record.fields["answer"]]}
        assert record.token_ids.count(image_id) == 1 and "images" not in record.fields
        assert record.text.startswith("<|user|><image>color:")
        assert record.image_sources == (f"images/train-{record.index}-0.png",)  # as `check` names it
    answers = {record.fields["answer"] for record in records}
    assert answers == set(COLORS), answers  # every color drawn (24 rows, 3 colors)
    expanded = len(model_inputs(processor, records[0].text, records[0].images)[0])
    assert expanded == len(records[0].token_ids) + 6  # the placeholder: 7 tokens (4 image tokens and 3 around them)
    assert encode_prompts(rows[:4], processor.tokenizer, expanded, processor=processor)[1] == 0
    with pytest.raises(Exception, match="longer than max_prompt_tokens"):  # the expanded length is what counts
        encode_prompts(rows[:4], processor.tokenizer, expanded - 1, processor=processor)

    held_out = read_source(str(eval_path), "test", None, FieldsConfig(images="images"), "data.eval_path")
    assert not {row["images"][0] for row in held_out} & {row["images"][0] for row in rows}  # other pictures


def test_a_rows_images_that_are_missing_or_unreadable_are_refused_naming_the_row(tmp_path):
    from grpo_dist.config.sections import FieldsConfig
    from grpo_dist.data import DatasetError
    from grpo_dist.data.sources import read_source

    (tmp_path / "red.png").write_bytes(png(RED))
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "a", "answer": "1", "picture": "red.png"}\n{"prompt": "b", "answer": "2"}\n')
    fields = FieldsConfig(images="picture")
    with pytest.raises(DatasetError, match=r"rows.jsonl: row 2: no images column 'picture' \(data.fields.images"):
        read_source(str(data), "train", None, fields, "data.path")
    data.write_text('{"prompt": "a", "answer": "1", "picture": []}\n')
    with pytest.raises(DatasetError, match=r"rows.jsonl: row 1: no image in its column 'picture'"):
        read_source(str(data), "train", None, fields, "data.path")
    data.write_text('{"prompt": "a", "answer": "1", "picture": ["red.png", "blue.png"]}\n')
    with pytest.raises(DatasetError, match=r"rows.jsonl: row 1, picture\[1\]: cannot read the image"):
        read_source(str(data), "train", None, fields, "data.path")
    data.write_text('{"prompt": "a", "answer": "1", "picture": "red.png"}\n')
    (row,) = read_source(str(data), "train", None, fields, "data.path")
    assert row["images"] == [png(RED)] and "picture" not in row  # relative to the file's folder


@pytest.mark.parametrize(
    ("change", "said"),
    [
        pytest.param({"learner": {"packing": True}}, "learner.packing", id="packing"),
        pytest.param({"learner": {"packing": False, "lora": {"rank": 4}}}, "learner.lora", id="lora"),
        pytest.param({"data": {"chat_template": False}}, "data.chat_template: false", id="no-template"),
        pytest.param(
            {"reward": {"model": {"path": "org/rm"}, "functions": [{"name": "reward_model", "weight": 1}]}},
            "reward.judge or reward.model",
            id="reward-model",
        ),
        pytest.param({"sft": {"base": "base"}}, "an sft warm-up", id="sft"),
    ],
)
def test_images_are_refused_where_a_run_cannot_take_them(tmp_path, change, said):
    from conftest import small_config

    from grpo_dist.config import ConfigError, load_config

    raw = small_config(tmp_path, learner={"packing": False})
    raw["data"]["task"] = {"name": "color", "num_train": 8, "num_eval": 2}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    accepted = load_config(path)  # without the change, the run is taken
    for section, values in change.items():
        raw[section] = {**raw.get(section, {}), **values}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_config(path)
    assert accepted.data.images_column == "images"


def test_a_text_model_given_images_is_refused_before_any_actor_starts(tmp_path):
    from conftest import small_config

    from grpo_dist.config import ConfigError, load_config
    from grpo_dist.models import build_tiny_model
    from grpo_dist.run.inputs import load_processor

    raw = small_config(tmp_path, learner={"packing": False})
    raw["data"]["task"] = {"name": "color", "num_train": 8, "num_eval": 2}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    model = build_tiny_model(tmp_path / "text-model")
    with pytest.raises(ConfigError, match="is not a vision-language model"):
        load_processor(load_config(path), str(model))


def test_a_micro_batch_of_rows_with_more_fewer_or_no_images_scores_each_row_as_it_scores_alone(vision_model):
    """Rows' pixels combined for one forward (padded to the most images with all-zero images, which the model
    skips): each row's logits are those of its own forward, the image-less row's those of its text alone."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from grpo_dist.models.vision import batch_pixels, row_pixels

    processor = AutoProcessor.from_pretrained(vision_model)
    model = AutoModelForImageTextToText.from_pretrained(vision_model, dtype=torch.float32).eval()
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "color?"}]}]
    texts = [processor.apply_chat_template(turns, add_generation_prompt=True) for turns in (QUESTION, two)]
    rows = [
        model_inputs(processor, texts[0], [png(RED)]),
        model_inputs(processor, texts[1], [png(BLUE), png(RED)]),
        (processor.tokenizer("<|user|>color?<eos>\n<|assistant|>")["input_ids"], {}),
    ]
    images = [[png(RED)], [png(BLUE), png(RED)], []]
    pixels = batch_pixels([row_pixels(processor.image_processor, each) for each in images])
    assert pixels["pixel_values"].shape == (3, 2, 3, 56, 56) and not pixels["pixel_values"][0, 1].any()
    length = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([each + [0] * (length - len(each)) for each, _ in rows])
    mask = torch.tensor([[1] * len(each) + [0] * (length - len(each)) for each, _ in rows])
    with torch.no_grad():
        together = model(input_ids=ids, attention_mask=mask, **pixels).logits
        for row, (each, tensors) in enumerate(rows):
            alone = model(input_ids=torch.tensor([each]), **tensors).logits[0]
            assert torch.allclose(together[row, : len(each)], alone, atol=1e-5), row
    assert not torch.allclose(together[0, : len(rows[0][0])], together[1, : len(rows[0][0])], atol=1e-3)


def test_a_batchs_rows_keep_their_images_through_selection_and_trimming():
    from grpo_dist.algo.batch import collate
    from grpo_dist.types import Completion

    completions = [
        Completion(index, [1, 2], [3] * (index + 1), "", [-0.1] * (index + 1), "stop", 0) for index in range(3)
    ]
    images = [(png(RED),), (png(BLUE),), ()]
    batch = collate(completions, torch.zeros(3), 0, images=images)
    picked = batch.select(torch.tensor([2, 0])).trimmed()
    assert picked.images == [(), (png(RED),)] and picked.input_ids.shape == (2, 5)
    assert batch.select(slice(1, 2)).images == [(png(BLUE),)]
    assert collate(completions, torch.zeros(3), 0).images is None


def test_the_plan_counts_the_vision_tower_with_the_text_model(vision_model):
    from transformers import AutoModelForImageTextToText

    from grpo_dist.config.plan import Shape

    model = AutoModelForImageTextToText.from_pretrained(vision_model)
    tower = sum(p.numel() for name, p in model.named_parameters() if ".text_model." not in name)
    shape = Shape.of(vision_model)
    assert shape.params == sum(p.numel() for p in model.parameters())  # tied head counted once, as the model has it
    assert shape.vision_params == tower > 0 and (shape.layers, shape.hidden) == (2, 128)  # the text model's


VISION = Path(__file__).parent.parent / "configs" / "vision.yaml"
STEPS = 80


@pytest.mark.slow
def test_the_vision_recipe_learns_the_color_in_its_pictures_with_the_engines_log_probs_the_learners(
    ray_cluster, capfd, tmp_path
):
    """configs/vision.yaml as shipped, shortened: the reward rises past what the format alone gives (0.2, and a third
    of 0.8 by chance), the held-out accuracy with it, and the learner's log-probs of the sampled tokens (its forward
    on the same pixels) stay those the engine sampled with, also for pictures seen again after the weights moved (an
    engine that kept their vision-tower outputs from the first time was 3e-2 apart by then). The final model loads
    with its processor, its vision tower trained."""
    from conftest import train_here
    from test_resume import rows

    raw = yaml.safe_load(VISION.read_text())
    raw["run"].update(output_dir=str(tmp_path / "outputs"), steps=STEPS)
    raw["model"]["path"] = str(tmp_path / "model")
    raw["data"]["task"]["num_train"] = 320  # its pictures seen again from step 21 on, with weights that moved since
    raw["eval"] = {"every": 0, "sets": [{"name": "held_out"}]}
    raw["wandb"] = {"enabled": False}
    config = tmp_path / "vision.yaml"
    config.write_text(yaml.safe_dump(raw))
    code, output = train_here(capfd, config)
    assert code == 0, output[-3000:]
    run_dir = tmp_path / "outputs" / "vision"
    logged, held_out = rows(run_dir), [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    accuracy = {row["step"]: row["eval/held_out/accuracy"] for row in held_out}
    rewards = [row["reward/mean"] for row in logged]
    gaps = [row["logprob_gap"] for row in logged]
    print(f"reward {rewards[0]:.2f} -> {statistics.mean(rewards[-5:]):.2f}, held-out {accuracy}, gap {max(gaps):.1e}")
    assert [row["step"] for row in logged] == list(range(1, STEPS + 1))
    assert statistics.mean(rewards[-5:]) >= 0.2 + 0.8 * 0.5, rewards  # right half the time: by chance a third
    assert accuracy[0] <= 0.34 and accuracy[STEPS] >= 0.5, accuracy
    assert max(gaps) < 1e-3, gaps  # the engine and the learner read the same pixels

    from transformers import AutoModelForImageTextToText, AutoProcessor

    final = run_dir / "final"  # the trained model, loadable with its processor, the tower trained too
    trained, initial = (AutoModelForImageTextToText.from_pretrained(path) for path in (final, tmp_path / "model"))
    assert AutoProcessor.from_pretrained(final).image_processor is not None
    tower = {name: p for name, p in initial.named_parameters() if "vision_model" in name}
    assert all(not torch.equal(tower[name], p) for name, p in trained.named_parameters() if name in tower)


@pytest.mark.slow
def test_an_image_run_killed_at_its_checkpoint_and_resumed_matches_the_whole_run(ray_cluster, capfd, tmp_path):
    """A 4-step run of the vision recipe, whole and SIGKILLed once its step-2 checkpoint is written then resumed:
    the same figures at every step (the images drawn, sampled and trained on as the whole run's were)."""
    import time

    from conftest import driver_of, train_here
    from test_resume import COMPARED, grpo_dist, rows

    raw = yaml.safe_load(VISION.read_text())
    raw["run"].update(output_dir=str(tmp_path / "outputs"), steps=4)
    raw["model"]["path"] = str(tmp_path / "model")  # built by the first run, read by the others
    raw["data"]["task"].update(num_train=64, num_eval=8)
    raw.update(eval={"every": 0, "sets": [{"name": "held_out"}]}, wandb={"enabled": False})
    raw["checkpoint"] = {"every_steps": 2, "keep": 1}
    configs = {}
    for name in ("whole", "resumed"):
        raw["run"]["name"] = name
        configs[name] = tmp_path / f"{name}.yaml"
        configs[name].write_text(yaml.safe_dump(raw))
    code, out = train_here(capfd, configs["whole"])
    assert code == 0, out[-3000:]

    joined = f"ray.address={ray_cluster.get_runtime_context().gcs_address}"
    interrupted = grpo_dist("train", str(configs["resumed"]), joined, start_new_session=True)
    run_dir, deadline = tmp_path / "outputs" / "resumed", time.monotonic() + 600
    while not (run_dir / "checkpoints" / "latest").exists():
        assert interrupted.poll() is None and time.monotonic() < deadline, "the run ended before its checkpoint"
        time.sleep(0.1)
    driver = driver_of(interrupted)
    driver.kill()
    driver.wait(timeout=60)
    interrupted.wait(timeout=60)
    code, out = train_here(capfd, configs["resumed"], resume=True)
    assert code == 0, out[-3000:]
    assert "after step 2" in out, out[-3000:]

    expected, got = rows(tmp_path / "outputs" / "whole"), rows(run_dir)
    assert [row["step"] for row in got] == [1, 2, 3, 4]
    compared = [key for key in COMPARED if key in expected[0]]  # (no KL: the recipe's beta is 0)
    assert {"reward/mean", "loss", "grad_norm"} <= set(compared)
    for want, have in zip(expected, got, strict=True):
        for key in compared:
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (want["step"], key)
    assert expected[-1]["grad_norm"] > 0  # training moved the weights


def test_images_of_other_sizes_are_padded_to_the_largest_with_their_mask_false_there():
    from grpo_dist.models.vision import batch_pixels

    def row(images: int, height: int, width: int) -> dict:
        return {
            "pixel_values": torch.ones(1, images, 3, height, width),
            "pixel_attention_mask": torch.ones(1, images, height, width, dtype=torch.bool),
        }

    pixels = batch_pixels([row(1, 56, 42), {}, row(2, 40, 56)])
    values, mask = pixels["pixel_values"], pixels["pixel_attention_mask"]
    assert values.shape == (3, 2, 3, 56, 56) and mask.shape == (3, 2, 56, 56)
    assert mask[0, 0].sum() == 56 * 42 and not mask[0, 0, :, 42:].any() and not mask[0, 1].any()
    assert not mask[1].any() and mask[2, :, :40].all() and not mask[2, :, 40:].any()
    assert values[0, 0, :, :, :42].eq(1).all() and values[0, 0, :, :, 42:].eq(0).all()
