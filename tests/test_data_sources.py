"""Data in the layouts people bring (`grpo_dist.data.sources`): a `save_to_disk` directory of splits, a CSV file, a
hub dataset resolved offline from a cache filled the way the hub client fills it; columns mapped by `data.fields`,
chat turns, a system prompt, the chat template on or off; GSM8K and MATH prepared; and the pre-flight's answers to
bad inputs (`grpo-dist check` exits 2 naming what and where, before anything starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, TESTS_DIR, small_config

from grpo_dist.config_sections import FieldsConfig
from grpo_dist.data import DatasetError
from grpo_dist.data.dataset import encode_prompts, prompt_text
from grpo_dist.data.prepare import gsm8k_answer, last_boxed, prepare
from grpo_dist.data.sources import read_source
from grpo_dist.models.tiny import build_tiny_tokenizer

SUMS = [{"question": f"{a}+{b}=", "solution": str(a + b), "level": a % 3} for a in range(6) for b in range(6)]
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A `save_to_disk` directory with train and test splits and columns of its own naming."""
    from datasets import Dataset, DatasetDict

    path = tmp_path_factory.mktemp("saved") / "sums"
    DatasetDict({"train": Dataset.from_list(SUMS[:30]), "test": Dataset.from_list(SUMS[30:])}).save_to_disk(path)
    return path


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """An HF_HOME whose hub cache holds the dataset `acme/sums` (subset `main`: train and test) as the hub client
    leaves it: refs/main naming a commit, the snapshot of that commit with its README's configs and Parquet files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    home = tmp_path_factory.mktemp("hf")
    repo, commit = home / "hub" / "datasets--acme--sums", "d" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    (snapshot / "main").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(SUMS[:30]), snapshot / "main" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(SUMS[30:]), snapshot / "main" / "test-00000-of-00001.parquet")
    (snapshot / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train-*\n"
        "  - split: test\n    path: main/test-*\n---\n"
    )
    return home


MAPPED = FieldsConfig(prompt="question", answer="solution")


def test_a_saved_dataset_is_read_by_split_with_its_columns_mapped(saved):
    rows = read_source(str(saved), "test", None, MAPPED, "data.path")
    assert rows == [{"prompt": r["question"], "answer": r["solution"], "level": r["level"]} for r in SUMS[30:]]
    with pytest.raises(
        DatasetError, match=r"data.eval_path: .*sums has no split 'validation' \(it has \['test', 'train'\]\)"
    ):
        read_source(str(saved), "validation", None, MAPPED, "data.eval_path")


def test_an_unmapped_answer_column_is_named_with_the_columns_there_are(saved):
    with pytest.raises(DatasetError, match=r"row 1: no answer column 'answer' \(data.fields.answer; columns: "
                       r"\['level', 'question', 'solution'\]\)"):  # fmt: skip
        read_source(str(saved), "train", None, FieldsConfig(prompt="question"), "data.path")
    with pytest.raises(DatasetError, match=r"row 1: missing prompt field 'prompt' .* set data.fields.prompt"):
        read_source(str(saved), "train", None, FieldsConfig(answer="solution"), "data.path")
    no_answer = read_source(str(saved), "train", None, FieldsConfig(prompt="question", answer=None), "data.path")
    assert "answer" not in no_answer[0] and no_answer[0]["solution"] == "0"  # a reward can still read it


def test_a_csv_file_is_read(tmp_path):
    path = tmp_path / "sums.csv"
    path.write_text("question,solution\n1+1=,2\n2+3=,5\n")
    rows = read_source(str(path), "train", None, MAPPED, "data.path")
    assert [(r["prompt"], str(r["answer"])) for r in rows] == [("1+1=", "2"), ("2+3=", "5")]


def test_a_hub_dataset_resolves_offline_from_the_cache(hf_home, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = (
        "import json, sys; from grpo_dist.config_sections import FieldsConfig; "
        "from grpo_dist.data.sources import read_source; "
        "print(json.dumps(read_source('acme/sums', sys.argv[1], sys.argv[2], "
        "FieldsConfig(prompt='question', answer='solution'), 'data.path')))"
    )

    def read(split, subset):
        return subprocess.run([sys.executable, "-c", code, split, subset], capture_output=True, text=True)

    done = read("test", "main")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [row["prompt"] for row in rows] == [row["question"] for row in SUMS[30:]]
    assert "data.path: acme/sums@main is" in done.stdout
    wrong_subset = read("test", "other")
    assert (
        wrong_subset.returncode == 1 and "BuilderConfig 'other' not found. Available: ['main']" in wrong_subset.stderr
    )


def test_chat_turns_a_system_prompt_and_the_template_switch():
    tokenizer = build_tiny_tokenizer(TEMPLATE)
    row = {"prompt": "1+1=", "answer": "2"}
    assert prompt_text(row, tokenizer) == "<user>1+1=</user><assistant>"
    assert prompt_text(row, tokenizer, "Be brief.") == "<system>Be brief.</system><user>1+1=</user><assistant>"
    assert prompt_text(row, tokenizer, "Be brief.", chat_template=False) == "Be brief.\n\n1+1="
    turns = {"messages": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"},
                          {"role": "user", "content": "and 3+3?"}]}  # fmt: skip
    assert prompt_text(turns, tokenizer) == "<user>2+2=</user><assistant>4</assistant><user>and 3+3?</user><assistant>"
    records, _ = encode_prompts([turns, row], tokenizer, 256, "Be brief.")
    assert records[0].text.startswith("<system>Be brief.</system><user>2+2=</user>") and records[1].fields == {
        "answer": "2"
    }
    plain = build_tiny_tokenizer()
    with pytest.raises(
        DatasetError, match="data.chat_template is true, but the tokenizer of model.path has no chat template"
    ):
        prompt_text(row, plain, chat_template=True)
    with pytest.raises(DatasetError, match="data.fields.messages: chat turns need a chat template"):
        prompt_text(turns, plain)


def test_gsm8k_and_math_are_prepared_with_their_final_answers(tmp_path):
    assert gsm8k_answer("She pays 3 * 4 = 12.\n#### 1,012") == "1012" and gsm8k_answer("no marker") is None
    assert last_boxed(r"So $x = \boxed{\frac{1}{2}}$, not \boxed{3}? No: \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{a{b}c}") == "a{b}c" and last_boxed("none") is None
    gsm8k = tmp_path / "gsm8k.jsonl"
    gsm8k.write_text(json.dumps({"question": "3 apples and 4 more?", "answer": "3 + 4 = 7\n#### 7"}) + "\n")
    out = prepare("gsm8k", str(gsm8k), tmp_path / "out" / "train.jsonl")
    assert json.loads(out.read_text()) == {
        "prompt": "3 apples and 4 more?",
        "answer": "7",
        "solution": "3 + 4 = 7\n#### 7",
    }
    math = tmp_path / "math.jsonl"
    math.write_text(json.dumps({"problem": "Halve 1.", "solution": r"It is $\boxed{\frac12}$."}) + "\n"
                    + json.dumps({"problem": "Again?", "solution": "No box."}) + "\n")  # fmt: skip
    with pytest.raises(DatasetError, match=r"math.jsonl: row 2: no final answer \(a \\boxed\{...\}\)"):
        prepare("math", str(math), tmp_path / "math-out.jsonl")
    assert not (tmp_path / "math-out.jsonl").exists()


def check(tmp_path: Path, data: dict, env: dict | None = None) -> subprocess.CompletedProcess:
    raw = small_config(tmp_path, data={"task": None, "max_prompt_tokens": 24, "prompts_per_step": 4, **data})
    raw["model"]["tiny"] = {"characters": "0123456789+=: abcdefghijklmnopqrstuvwxyz.?"}
    raw["rollout"]["max_model_len"] = 32
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    environment = {**os.environ, "PYTHONPATH": str(TESTS_DIR), **(env or {})}
    return subprocess.run([sys.executable, "-m", "grpo_dist", "check", str(config)], cwd=REPO, env=environment,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_check_passes_a_mapped_dataset_and_shows_its_first_prompt(tmp_path, saved):
    result = check(tmp_path, {"path": str(saved), "eval_path": str(saved), "fields": {"prompt": "question",
                   "answer": "solution"}, "system_prompt": "add."})  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "first prompt, as the model reads it: 'add.\\n\\n0+0='" in result.stdout


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"fields": {"prompt": "question"}}, "no answer column 'answer' (data.fields.answer; columns: "),
        ({"split": "validation"}, "has no split 'validation' (it has ['test', 'train'])"),
        (
            {"fields": {"messages": "question", "answer": "solution"}},
            "data.fields.messages column 'question' must hold chat turns",
        ),
    ],
    ids=["unmapped-answer", "missing-split", "not-chat-turns"],
)
def test_check_refuses_bad_data_before_anything_starts(tmp_path, saved, data, message):
    result = check(tmp_path, {"path": str(saved), **data})
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "outputs").exists()


def test_check_refuses_answers_the_reward_cannot_read(tmp_path):
    """Text answers judged by math_answer: no completion could ever score, which the first row shows."""
    capitals = tmp_path / "capitals.jsonl"
    pairs = [("fr", "paris"), ("de", "berlin"), ("it", "rome"), ("es", "madrid")]
    capitals.write_text("".join(json.dumps({"prompt": f"capital {c}?", "answer": a}) + "\n" for c, a in pairs))
    refused = check(tmp_path, {"path": str(capitals)})
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "data.path: the first row's answer 'paris', given as the completion, scores 0.0 with eval.reward=" \
        "math_answer, not 1.0" in refused.stderr  # fmt: skip
    raw = small_config(tmp_path, data={"task": None, "path": str(capitals), "max_prompt_tokens": 24,
                                       "prompts_per_step": 4}, eval={"reward": "exact_answer"})  # fmt: skip
    raw["model"]["tiny"] = {"characters": "0123456789+=: abcdefghijklmnopqrstuvwxyz.?"}
    (tmp_path / "exact.yaml").write_text(yaml.safe_dump(raw))
    command = [sys.executable, "-m", "grpo_dist", "check", str(tmp_path / "exact.yaml")]
    env = {**os.environ, "PYTHONPATH": str(TESTS_DIR)}
    judged = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert judged.returncode == 0, judged.stderr


def test_prepare_gsm8k_from_the_command_line(tmp_path):
    raw = tmp_path / "gsm8k.jsonl"
    raw.write_text("".join(json.dumps({"question": f"{a}+1=", "answer": f"{a} plus 1\n#### {a + 1:,}"}) + "\n"
                           for a in range(999, 1007)))  # fmt: skip
    command = [sys.executable, "-m", "grpo_dist", "prepare", "gsm8k", str(raw), str(tmp_path / "p.jsonl")]
    prepared = subprocess.run(command, capture_output=True, text=True, check=True)
    assert "8 rows written" in prepared.stdout
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [row["answer"] for row in rows[:2]] == ["1000", "1001"] and rows[0]["prompt"] == "999+1="
    assert check(tmp_path, {"path": str(tmp_path / "p.jsonl")}).returncode == 0
