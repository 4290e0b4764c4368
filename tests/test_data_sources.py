"""Data in the layouts people bring (`grpo_dist.data.sources`): a `save_to_disk` directory of splits, a CSV file, a
hub dataset resolved offline from a cache filled the way the hub client fills it; columns mapped by `data.fields`,
chat turns, a system prompt, the chat template on or off; GSM8K and MATH prepared; and the pre-flight's answers to
bad inputs (`grpo-dist check` exits 2 naming what and where, before anything starts)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, Ran, cli_here, small_config

from grpo_dist.config.sections import FieldsConfig
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
        "import json, sys; from grpo_dist.config.sections import FieldsConfig; "
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
    out, _ = prepare("gsm8k", str(gsm8k), tmp_path / "out" / "train.jsonl")
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


def check(capfd, tmp_path: Path, data: dict) -> Ran:
    raw = small_config(tmp_path, data={"task": None, "max_prompt_tokens": 24, "prompts_per_step": 4, **data})
    raw["model"]["tiny"] = {"characters": "0123456789+=: abcdefghijklmnopqrstuvwxyz.?\n"}
    raw["rollout"]["max_model_len"] = 32
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    return cli_here(capfd, "check", str(config), cwd=REPO)


def test_check_passes_a_mapped_dataset_and_shows_its_first_prompt(capfd, tmp_path, saved):
    result = check(capfd, tmp_path, {"path": str(saved), "eval_path": str(saved), "fields": {"prompt": "question",
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
def test_check_refuses_bad_data_before_anything_starts(capfd, tmp_path, saved, data, message):
    result = check(capfd, tmp_path, {"path": str(saved), **data})
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "outputs").exists()


def test_check_refuses_answers_the_reward_cannot_read(capfd, tmp_path):
    """Text answers judged by math_answer: no completion could ever score, which the first row shows."""
    capitals = tmp_path / "capitals.jsonl"
    pairs = [("fr", "paris"), ("de", "berlin"), ("it", "rome"), ("es", "madrid")]
    capitals.write_text("".join(json.dumps({"prompt": f"capital {c}?", "answer": a}) + "\n" for c, a in pairs))
    refused = check(capfd, tmp_path, {"path": str(capitals)})
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "data.path: the first row's answer 'paris', given as the completion, scores 0.0 with eval.reward=" \
        "math_answer, not 1.0" in refused.stderr  # fmt: skip
    raw = small_config(tmp_path, data={"task": None, "path": str(capitals), "max_prompt_tokens": 24,
                                       "prompts_per_step": 4}, eval={"reward": "exact_answer"})  # fmt: skip
    raw["model"]["tiny"] = {"characters": "0123456789+=: abcdefghijklmnopqrstuvwxyz.?"}
    (tmp_path / "exact.yaml").write_text(yaml.safe_dump(raw))
    judged = cli_here(capfd, "check", str(tmp_path / "exact.yaml"), cwd=REPO)
    assert judged.returncode == 0, judged.stderr


def test_prepare_gsm8k_from_the_command_line(capfd, tmp_path):
    raw = tmp_path / "gsm8k.jsonl"
    raw.write_text("".join(json.dumps({"question": f"{a}+1=", "answer": f"{a} plus 1\n#### {a + 1:,}"}) + "\n"
                           for a in range(999, 1007)))  # fmt: skip
    prepared = cli_here(capfd, "prepare", "gsm8k", str(raw), str(tmp_path / "p.jsonl"))
    assert prepared.returncode == 0, prepared.stderr
    assert "8 rows written" in prepared.stdout
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [row["answer"] for row in rows[:2]] == ["1000", "1001"] and rows[0]["prompt"] == "999+1="
    assert check(capfd, tmp_path, {"path": str(tmp_path / "p.jsonl")}).returncode == 0


def hub_dataset(home: Path, repo_id: str, subset: str, splits: dict[str, list[dict]]) -> None:
    """Put `repo_id` in the hub cache of HF_HOME `home` as the hub client leaves it, its rows as the dataset's own
    Parquet files under the subset `subset` (the README's configs name its splits)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo, commit = home / "hub" / f"datasets--{repo_id.replace('/', '--')}", "e" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    (snapshot / subset).mkdir(parents=True)
    files = ""
    for split, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows), snapshot / subset / f"{split}-00000-of-00001.parquet")
        files += f"  - split: {split}\n    path: {subset}/{split}-*\n"
    (snapshot / "README.md").write_text(f"---\nconfigs:\n- config_name: {subset}\n  data_files:\n{files}---\n")


DAPO_PROMPT = (
    "Solve the following math problem step by step. The last line of your response should be of the form Answer: "
    "$Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\nRemember to put your answer on its "
    'own line after "Answer:".'
)


def diagram() -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (32, 24), "white")
    ImageDraw.Draw(image).line((2, 20, 30, 4), fill="black")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


DIAGRAM = diagram()


def picture(image: Path | bytes) -> tuple:
    """An image's size and pixels, however it is encoded."""
    from PIL import Image

    with Image.open(image if isinstance(image, Path) else io.BytesIO(image)) as opened:
        return opened.size, opened.convert("RGB").tobytes()


def dapo_row(problem: str, answer: str) -> dict:
    return {"data_source": "math_dapo", "prompt": [{"content": DAPO_PROMPT.format(problem), "role": "user"}],
            "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"id-{problem}"}}  # fmt: skip


MBPP_FULL = {
    "task_id": 11,
    "text": "Write a function to add two numbers.",
    "code": "def add(a, b):\n    return a + b",
    "test_list": ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 0) == ZERO"],
    "test_setup_code": "ZERO = 0",
    "challenge_test_list": [],
}
MBPP_SANITIZED = {
    "source_file": "Benchmark Questions Verification V2.ipynb",
    "task_id": 12,
    "prompt": "Write a function to find the square root.",
    "code": "import math\ndef root(x):\n    return math.sqrt(x)",
    "test_imports": ["import math"],
    "test_list": ["assert math.isclose(root(4), 2)"],
}
# Each recipe's source in its own layout on the hub: (layout, hub id, subset, {split: rows}, rows expected written)
SOURCES = [
    ("gsm8k", "openai/gsm8k", "main", {"train": [{"question": "3 and 4?", "answer": "3 + 4 = 7\n#### 7"}]},
     [{"prompt": "3 and 4?", "answer": "7", "solution": "3 + 4 = 7\n#### 7"}]),
    ("math", "DigitalLearningGmbH/MATH-lighteval", "default",
     {"train": [{"problem": "Halve 1.", "level": "Level 1", "solution": r"So $\boxed{\frac12}$.", "type": "Algebra"}]},
     [{"prompt": "Halve 1.", "answer": r"\frac12", "solution": r"So $\boxed{\frac12}$."}]),
    ("dapo-math", "BytedTsinghua-SIA/DAPO-Math-17k", "default",
     {"train": [dapo_row("What is 2+2?", "4"), dapo_row("What is 3*3?", "9"), dapo_row("What is 2+2?", "4")]},
     [{"prompt": DAPO_PROMPT.format("What is 2+2?"), "answer": "4"},
      {"prompt": DAPO_PROMPT.format("What is 3*3?"), "answer": "9"}]),
    ("aime", "HuggingFaceH4/aime_2024", "default",
     {"train": [{"id": 60, "problem": "Find N.", "solution": "...", "answer": "204", "url": "u", "year": "2024"}]},
     [{"prompt": "Find N.", "answer": "204"}]),
    ("geo3k", "hiyouga/geometry3k", "default",
     {"train": [{"images": [{"bytes": DIAGRAM, "path": "d.png"}], "problem": "<image>Find x.", "answer": "3"}]},
     [{"prompt": "Find x.", "answer": "3", "images": ["out-images/0-0.png"]}]),
    ("mbpp", "google-research-datasets/mbpp", "full", {"train": [MBPP_FULL], "test": [MBPP_FULL]},
     [{"prompt": "Write a function to add two numbers.\nYour code should pass these tests:\nassert add(1, 2) == 3\n"
                 "assert add(2, 2) == 4\nassert add(0, 0) == ZERO\nAnswer with the code in a ```python block.",
       "answer": "```python\ndef add(a, b):\n    return a + b\n```",
       "tests": ["ZERO = 0\nassert add(1, 2) == 3", "ZERO = 0\nassert add(2, 2) == 4",
                 "ZERO = 0\nassert add(0, 0) == ZERO"]}]),
]  # fmt: skip


@pytest.mark.parametrize(("layout", "repo_id", "subset", "splits", "expected"), SOURCES, ids=[s[0] for s in SOURCES])
def test_each_recipes_dataset_is_prepared_from_its_layout_on_the_hub(tmp_path, layout, repo_id, subset, splits,
                                                                       expected):  # fmt: skip
    """Rows in each source's own layout, in a hub cache read offline under the source's own id, with the layout's
    own subset and split: what is written is the prompt and the answer the reward compares with."""
    hub_dataset(tmp_path / "hf", repo_id, subset, splits)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "grpo_dist", "prepare", layout, repo_id, str(tmp_path / "out.jsonl")]
    prepared = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert prepared.returncode == 0, prepared.stderr
    assert [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()] == expected
    for row in expected:  # a row's images written beside the file, the source's pictures
        assert all(picture(tmp_path / path) == picture(DIAGRAM) for path in row.get("images", []))
    repeated = len(splits["train"]) - len(expected)  # DAPO's hub copy repeats its problems
    assert (f"; {repeated} repeated prompts left out" in prepared.stdout) == (repeated > 0), prepared.stdout


def test_mbpps_sanitized_subset_and_a_row_the_layout_cannot_read(tmp_path):
    source = tmp_path / "sanitized.jsonl"
    source.write_text(json.dumps(MBPP_SANITIZED) + "\n")
    (row,) = [json.loads(line) for line in prepare("mbpp", str(source), tmp_path / "s.jsonl", subset="sanitized")[0]
              .read_text().splitlines()]  # fmt: skip
    assert row["prompt"].startswith("Write a function to find the square root.\nYour code should pass these tests:")
    assert row["tests"] == ["import math\nassert math.isclose(root(4), 2)"]
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({**MBPP_FULL, "test_list": []}) + "\n")
    with pytest.raises(DatasetError, match=r"broken.jsonl: row 1: no 'code' and 'test_list'"):
        prepare("mbpp", str(broken), tmp_path / "b.jsonl")
    assert not (tmp_path / "b.jsonl").exists()


def test_a_dotted_field_reaches_into_a_nested_column(tmp_path):
    """DAPO-Math-17k read as it is: chat turns in `prompt`, the answer in `reward_model.ground_truth` (Parquet keeps
    the nested column a struct; JSON Lines an object); a path that leads nowhere is named with the row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [dapo_row("What is 2+2?", "4"), dapo_row("What is 3*3?", "9")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dapo.parquet")
    (tmp_path / "dapo.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    fields = FieldsConfig(messages="prompt", answer="reward_model.ground_truth")
    for name in ("dapo.parquet", "dapo.jsonl"):
        read = read_source(str(tmp_path / name), "train", None, fields, "data.path")
        assert [row["answer"] for row in read] == ["4", "9"]
        assert read[1]["messages"] == rows[1]["prompt"] and read[1]["reward_model"]["style"] == "rule-lighteval/MATH_v2"
    wrong = FieldsConfig(messages="prompt", answer="reward_model.truth")
    with pytest.raises(DatasetError, match=r"row 1: no answer column 'reward_model.truth' \(data.fields.answer"):
        read_source(str(tmp_path / "dapo.jsonl"), "train", None, wrong, "data.path")


def test_prepare_from_the_command_line_says_what_it_wrote_and_left_out(capfd, tmp_path):
    source = tmp_path / "dapo.jsonl"
    source.write_text("".join(json.dumps(dapo_row(f"{n % 3}+1?", str(n % 3 + 1))) + "\n" for n in range(9)))
    prepared = cli_here(capfd, "prepare", "dapo-math", str(source), str(tmp_path / "p.jsonl"))
    assert prepared.returncode == 0, prepared.stderr
    assert f"3 rows written to {tmp_path / 'p.jsonl'} (prompt, answer); 6 repeated prompts left out" in prepared.stdout


def code_recipe_check(capfd, tmp_path: Path, rows: list[dict]) -> Ran:
    """`grpo-dist check configs/code.yaml` on MBPP rows prepared here, shrunk to a tiny model on the CPU."""
    tmp_path.mkdir()
    source = tmp_path / "mbpp.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    prepare("mbpp", str(source), tmp_path / "train.jsonl")
    overrides = [f"model.path={tmp_path / 'model'}", "model.tiny={}", f"data.path={tmp_path / 'train.jsonl'}",
                 f"data.eval_path={tmp_path / 'train.jsonl'}", f"run.output_dir={tmp_path / 'outputs'}",
                 "data.prompts_per_step=2", "data.max_prompt_tokens=240", "rollout.max_model_len=256",
                 "rollout.max_new_tokens=16", "rollout.num_generators=1", "rollout.num_gpus=0",
                 "rollout.dtype=auto", "learner.num_gpus=0", "learner.num_ranks=1", "reward.num_workers=1",
                 "wandb.enabled=false"]  # fmt: skip
    return cli_here(capfd, "check", str(REPO / "configs" / "code.yaml"), *overrides, cwd=REPO)


def test_the_code_recipe_checks_its_reference_solutions_against_the_tests(capfd, tmp_path):
    """The code recipe's pre-flight runs the first reference solution through its tests in the jail: MBPP's own
    passes; one that fails a test stops `check` (exit 2) before anything starts, naming the reward."""
    second = {**MBPP_FULL, "task_id": 13, "text": "Write a function to add three numbers."}
    passed = code_recipe_check(capfd, tmp_path / "good", [MBPP_FULL, second])
    assert passed.returncode == 0, passed.stdout[-2000:] + passed.stderr
    assert "first prompt, as the model reads it: 'Write a function to add two numbers." in passed.stdout
    wrong = {**MBPP_FULL, "code": "def add(a, b):\n    return a - b"}
    refused = code_recipe_check(capfd, tmp_path / "wrong", [wrong, second])
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    # add(0, 0) == 0 still holds: one test of three
    assert "scores 0.3333333333333333 with eval.reward=code_tests, not 1.0" in refused.stderr, refused.stderr


def test_characters_the_tokenizer_drops_are_shown_and_named(capfd, tmp_path, saved):
    """A tiny model's `characters` without those of the system prompt: the first prompt is shown as the model reads
    it (without them), and a warning names them."""
    result = check(capfd, tmp_path, {"path": str(saved), "eval_path": str(saved), "fields": {"prompt": "question",
                   "answer": "solution"}, "system_prompt": "Add, please!"})  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "first prompt, as the model reads it: 'dd please\\n\\n0+0='" in result.stdout
    assert "warning: the tokenizer of model.path drops characters of the prompts: '!,A' (model.tiny.characters)" \
        in result.stdout  # fmt: skip
