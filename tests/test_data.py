"""Dataset loading and its error messages, prompt encoding, batch sampling, and the bundled synthetic tasks."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from grpo_dist.agents.tools import calculator
from grpo_dist.data import (
    TASKS,
    DatasetError,
    PromptRecord,
    PromptSampler,
    encode_prompts,
    load_rows,
    make_task_rows,
    split_task,
    write_task,
)
from grpo_dist.data.tasks import COLORS
from grpo_dist.models import CHARACTERS, build_tiny_model, build_tiny_tokenizer

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def test_load_jsonl_skips_blank_lines(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", ['{"prompt": "1+1=", "answer": "2"}', "", "  ", '{"prompt": "2+2="}'])
    assert load_rows(path) == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}]


def test_load_jsonl_crlf_and_line_separator_in_string(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes('{"prompt": "a\u2028b"}\r\n{"prompt": "c"}\r\n'.encode())
    assert load_rows(path) == [{"prompt": "a\u2028b"}, {"prompt": "c"}]


def test_load_custom_prompt_field(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.json", ['{"question": "1+1=", "answer": "2"}'])
    assert load_rows(path, prompt_field="question") == [{"question": "1+1=", "answer": "2"}]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        pytest.param('{"prompt": "1+1=", ', "invalid JSON", id="invalid_json"),
        pytest.param('["1+1="]', "expected a JSON object, got list", id="not_an_object"),
        pytest.param('{"question": "1+1="}', "missing prompt field 'prompt'", id="missing_prompt"),
        pytest.param('{"prompt": "   "}', "must be a non-empty string, got '   '", id="blank_prompt"),
        pytest.param('{"prompt": 12}', "must be a non-empty string, got 12", id="prompt_not_string"),
    ],
)
def test_malformed_jsonl_row_names_file_and_line(tmp_path: Path, bad_line: str, message: str) -> None:
    # The bad row is on line 3: line 2 is blank and still counts.
    path = write_lines(tmp_path / "d.jsonl", ['{"prompt": "ok"}', "", bad_line, '{"prompt": "ok"}'])
    with pytest.raises(DatasetError, match=message) as error:
        load_rows(path)
    assert str(error.value).startswith(f"{path}:3: ")


def test_parquet_rows(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "2+3="], "answer": ["2", "5"]}), path)
    assert load_rows(path) == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+3=", "answer": "5"}]


def test_parquet_bad_row_names_row_number(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", None, "3+3="]}), path)
    with pytest.raises(DatasetError, match=r"d\.parquet: row 2: prompt field 'prompt' must be a non-empty string"):
        load_rows(path)


@pytest.mark.parametrize(
    ("name", "content", "error_type", "message"),
    [
        pytest.param("absent.jsonl", None, DatasetError, "dataset file not found", id="missing_file"),
        pytest.param("empty.jsonl", b"\n\n", DatasetError, "the dataset has no rows", id="empty_file"),
        pytest.param(
            "latin1.jsonl", '{"prompt": "caf\u00e9"}'.encode("latin-1"), DatasetError, "not UTF-8", id="not_utf8"
        ),
        pytest.param("bad.parquet", b"not parquet", DatasetError, "cannot read as Parquet", id="not_parquet"),
        pytest.param(
            "d.csv", b"prompt\n1+1=\n", DatasetError, r"unsupported dataset suffix '\.csv'.*\.parquet", id="csv"
        ),
    ],
)
def test_unreadable_dataset(tmp_path: Path, name: str, content: bytes | None, error_type: type, message: str) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(error_type, match=message) as error:
        load_rows(path)
    assert str(path) in str(error.value)


def test_encode_prompts_without_template(tokenizer) -> None:
    rows = [{"prompt": "1+2=", "answer": "3", "level": 1}]
    records, num_skipped = encode_prompts(rows, tokenizer, max_prompt_tokens=16)
    assert num_skipped == 0
    token_ids = tokenizer.convert_tokens_to_ids(list("1+2="))  # these four characters are their own tokens
    assert records == [PromptRecord(text="1+2=", token_ids=token_ids, fields={"answer": "3", "level": 1}, index=0)]


def test_encode_prompts_skips_and_counts_long_prompts(tokenizer) -> None:
    rows = [{"prompt": "1234"}, {"prompt": "12345"}, {"prompt": "123"}, {"prompt": "1234567"}]
    records, num_skipped = encode_prompts(rows, tokenizer, max_prompt_tokens=4)  # one token per character
    assert [record.index for record in records] == [0, 2]
    assert num_skipped == 2


def test_encode_prompts_all_too_long(tokenizer) -> None:
    with pytest.raises(DatasetError, match="all 2 prompts are longer than max_prompt_tokens=3"):
        encode_prompts([{"prompt": "1234"}, {"prompt": "12345"}], tokenizer, max_prompt_tokens=3)


def test_encode_prompts_applies_chat_template(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "model", chat_template=CHAT_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records, _ = encode_prompts([{"prompt": "1+2=", "answer": "3"}], tokenizer, max_prompt_tokens=64)
    assert records[0].text == "<bos>user: 1+2=\nassistant: "
    # "<bos>" is one special token (id 1), not five characters, then one token per character; nothing else added.
    body = tokenizer("user: 1+2=\nassistant: ", add_special_tokens=False)["input_ids"]
    assert len(body) == 22
    assert records[0].token_ids == [tokenizer.bos_token_id, *body]


def test_encode_prompts_template_counts_toward_limit(tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "model", chat_template=CHAT_TEMPLATE))
    # "<bos>user: 1+2=\nassistant: " is 1 + 22 tokens, over a limit the bare prompt (4 tokens) would meet.
    with pytest.raises(DatasetError, match="all 1 prompts"):
        encode_prompts([{"prompt": "1+2="}], tokenizer, max_prompt_tokens=10)


def make_records(count: int) -> list[PromptRecord]:
    return [PromptRecord(text=str(index), token_ids=[index], index=index) for index in range(count)]


def take(sampler: PromptSampler, num_batches: int) -> list[list[int]]:
    return [[record.index for record in next(sampler)] for _ in range(num_batches)]


def test_sampler_visits_every_record_once_per_epoch() -> None:
    sampler = PromptSampler(make_records(6), batch_size=3, seed=0)
    first_epoch = sum(take(sampler, 2), [])
    assert sorted(first_epoch) == list(range(6)) and sampler.epoch == 0
    second_epoch = sum(take(sampler, 2), [])
    assert sorted(second_epoch) == list(range(6)) and sampler.epoch == 1
    assert first_epoch != second_epoch  # reshuffled (fixed by the seed)


def test_sampler_batch_spans_epoch_boundary() -> None:
    sampler = PromptSampler(make_records(5), batch_size=3, seed=1)
    counts = Counter(sum(take(sampler, 5), []))  # 15 records = exactly 3 epochs
    assert counts == {index: 3 for index in range(5)} and sampler.epoch == 2


def test_sampler_is_deterministic_and_resumable() -> None:
    reference = take(PromptSampler(make_records(7), batch_size=3, seed=5), 6)
    sampler = PromptSampler(make_records(7), batch_size=3, seed=5)
    take(sampler, 4)
    resumed = PromptSampler(make_records(7), batch_size=3, seed=5)
    resumed.load_state_dict(sampler.state_dict())
    assert take(resumed, 2) == reference[4:]
    assert take(PromptSampler(make_records(7), batch_size=3, seed=6), 6) != reference


@pytest.mark.parametrize(
    ("records", "batch_size", "message"),
    [
        pytest.param([], 2, "no records", id="empty"),
        pytest.param(make_records(2), 0, "batch_size must be >= 1, got 0", id="zero_batch"),
    ],
)
def test_sampler_rejects_bad_arguments(records: list[PromptRecord], batch_size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PromptSampler(records, batch_size=batch_size, seed=0)


def solve(task: str, row: dict) -> str:
    prompt = row["prompt"]
    if task == "color":  # the digit naming the disc's color, which is the picture's centre pixel's
        (picture,) = row["images"]
        center = picture.draw().getpixel((picture.x, picture.y))
        return next(answer for answer, color in COLORS.items() if color == center)
    if task in ("add", "add_multi"):
        left, right = prompt.rstrip("=").split("+")
        return str(int(left) + int(right))
    if task == "multiply":
        left, right = prompt.rstrip("=").split("*")
        return str(int(left) * int(right))
    return prompt.rstrip(":").split()[-1]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_task_rows_are_correct_and_tokenizable(task: str) -> None:
    rows = make_task_rows(task, 200, seed=0)
    assert rows == make_task_rows(task, 200, seed=0)
    for row in rows:
        assert row["answer"] == solve(task, row)
        assert set(row["prompt"] + row["answer"]) <= set(CHARACTERS)
    if task == "multiply":  # the transcripts solve the row with the calculator; `solved` is one, or the answer
        for row in rows:
            call, answer = (
                json.loads(row["transcript"][1]["content"][len("<tool_call>") : -len("</tool_call>")]),
                row["answer"],
            )
            assert (
                calculator(**call["arguments"])
                == row["transcript"][2]["content"]
                == row["transcript"][3]["content"]
                == answer
            )
            assert row["solved"] in (row["transcript"], [row["transcript"][0], row["transcript"][3]])
        assert 0.4 < sum(len(row["solved"]) == 4 for row in rows) / len(rows) < 0.6  # half use the tool


def test_last_digit_prompt_shape() -> None:
    lengths = {len(row["prompt"].rstrip(":").split()) for row in make_task_rows("last_digit", 300, seed=0)}
    assert lengths == {2, 3, 4}


def test_write_task_roundtrips_through_load_rows(tmp_path: Path) -> None:
    path = write_task("add", tmp_path / "sub" / "add.jsonl", num_rows=10, seed=3)
    assert load_rows(path) == make_task_rows("add", 10, seed=3)


def test_unknown_task_lists_valid_names() -> None:
    valid = "add, add_multi, color, last_digit, multiply"
    with pytest.raises(ValueError, match=f"unknown task 'divide'; valid tasks: {valid}"):
        make_task_rows("divide", 5, seed=0)


def read_prompts(path: Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines()]


def test_split_last_digit_has_disjoint_eval(tmp_path: Path) -> None:
    train_path, eval_path = split_task("last_digit", tmp_path, num_train=2000, num_eval=300, seed=0)
    assert (train_path.name, eval_path.name) == ("train.jsonl", "eval.jsonl")
    train, held_out = read_prompts(train_path), read_prompts(eval_path)
    assert (len(train), len(held_out)) == (2000, 300)
    assert not set(train) & set(held_out)


def test_split_add_allows_overlap(tmp_path: Path) -> None:
    # 1000 train rows cover (almost) all 100 distinct "a+b=" prompts, so eval must overlap.
    train_path, eval_path = split_task("add", tmp_path, num_train=1000, num_eval=50, seed=0)
    assert len(read_prompts(eval_path)) == 50
    assert set(read_prompts(eval_path)) & set(read_prompts(train_path))


def test_add_multi_covers_one_and_two_digit_numbers() -> None:
    operands = {len(part) for row in make_task_rows("add_multi", 500, seed=0) for part in row["prompt"][:-1].split("+")}
    assert operands == {1, 2}
