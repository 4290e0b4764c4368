"""The tiny offline Qwen2 model: its character tokenizer, its config, and loading it with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_dist.models import CHARACTERS, HEAD_DIM, build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("12+3=15", id="arithmetic"),
        pytest.param("  two  spaces ", id="spaces_kept"),
        pytest.param("line one\n\tline two\n", id="newlines_and_tabs"),
        pytest.param("<bos>1+1=<eos>", id="special_tokens_in_text"),
        pytest.param(CHARACTERS, id="every_character"),
    ],
)
def test_tokenizer_roundtrip_one_token_per_character(tokenizer, text: str) -> None:
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(token_ids) == len(text.replace("<bos>", "^").replace("<eos>", "$"))  # a special token is one token
    assert tokenizer.decode(token_ids) == text


def test_non_ascii_character_is_dropped(tokenizer) -> None:
    # Qwen2Tokenizer's byte-level BPE has no unknown token: bytes outside the vocabulary vanish on encode.
    assert tokenizer.decode(tokenizer("aéb", add_special_tokens=False)["input_ids"]) == "ab"


def test_special_tokens_and_config_agree(model_dir: Path, tokenizer) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    generation = json.loads((model_dir / "generation_config.json").read_text())
    ids = {"pad": tokenizer.pad_token_id, "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id}
    assert ids == {"pad": 0, "bos": 1, "eos": 2} and tokenizer.unk_token_id == 3
    assert (config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]) == (0, 1, 2)
    assert generation["eos_token_id"] == 2
    assert config["vocab_size"] == len(tokenizer) == 4 + len(CHARACTERS)
    assert config["hidden_size"] // config["num_attention_heads"] == HEAD_DIM
    assert tokenizer.decode([1, 5, 2], skip_special_tokens=True) == tokenizer.decode([5])


def test_model_loads_and_runs_forward(model_dir: Path, tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.dtype == torch.float32
    assert 200_000 < sum(parameter.numel() for parameter in model.parameters()) < 500_000
    input_ids = torch.tensor([tokenizer("7 3 9:", add_special_tokens=False)["input_ids"]])  # [1, 6]
    logits = model(input_ids=input_ids).logits  # [1, 6, vocab]
    assert logits.shape == (1, 6, len(tokenizer))
    assert torch.isfinite(logits).all()


def test_same_seed_same_weights(model_dir: Path, tmp_path: Path) -> None:
    weights = (model_dir / "model.safetensors").read_bytes()
    assert (build_tiny_model(tmp_path / "same", seed=0) / "model.safetensors").read_bytes() == weights
    assert (build_tiny_model(tmp_path / "other", seed=1) / "model.safetensors").read_bytes() != weights


def test_chat_template_is_saved(tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path, chat_template=template))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1="}], add_generation_prompt=True, tokenize=False
    )
    assert text == "1+1=>"


@pytest.mark.parametrize(
    ("hidden_size", "num_heads", "fix"),
    [
        pytest.param(32, 2, "pass hidden_size=128.$", id="head_dim_16"),
        pytest.param(256, 2, "pass hidden_size=128 or num_heads=4.$", id="head_dim_128"),
    ],
)
def test_head_dim_must_be_64(tmp_path: Path, hidden_size: int, num_heads: int, fix: str) -> None:
    with pytest.raises(ValueError, match=f"num_heads={num_heads} does not give head_dim 64.*{fix}"):
        build_tiny_model(tmp_path, hidden_size=hidden_size, num_heads=num_heads)


def test_a_build_without_weights_writes_the_same_tokenizer_and_config(model_dir: Path, tmp_path: Path) -> None:
    """What a dry run reads (`grpo-dist check`): the tokenizer's files as a build with weights writes them, and a
    config.json transformers reads as the same config; no weights, nor the generation config that goes with them."""
    from transformers import AutoConfig

    light = build_tiny_model(tmp_path / "light", seed=0, weights=False)
    assert sorted(path.name for path in light.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (light / name).read_bytes() == (model_dir / name).read_bytes(), name
    read = [AutoConfig.from_pretrained(path).to_dict() for path in (light, model_dir)]
    for each in read:
        each.pop("_name_or_path")
    assert read[0] == read[1]
    with pytest.raises(ValueError, match="built with its weights"):
        build_tiny_model(tmp_path / "classifier", num_labels=1, weights=False)
