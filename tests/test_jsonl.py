"""The run's JSON Lines files after a crash: a torn last line is dropped with a warning, never an error; a rewrite is
atomic (a temporary file renamed over the original)."""

from __future__ import annotations

import json
import os

import pytest

from grpo_dist.run.metrics import MetricsSink
from grpo_dist.storage import jsonl

WHOLE = [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]


def write(path, rows, tail: str = "") -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + tail)


@pytest.mark.parametrize(
    "torn", ['{"step": 3, "lo', '{"step": 3', "{", '"abc'], ids=["mid-key", "mid-value", "brace", "str"]
)
def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path, capsys, torn):
    path = tmp_path / "metrics.jsonl"
    write(path, WHOLE, tail=torn)
    assert jsonl.read_rows(path) == WHOLE
    assert jsonl.read_rows(path, strict=True) == WHOLE  # torn is never an error, strict or not
    assert f"warning: {path}: dropped its last line, torn by a crash mid-write" in capsys.readouterr().out


def test_an_unreadable_line_inside_the_file_is_dropped_or_with_strict_an_error(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(WHOLE[0]) + "\n" + '{"step": 2,\n' + "[1, 2]\n" + json.dumps(WHOLE[1]) + "\n")
    assert jsonl.read_rows(path) == WHOLE
    said = capsys.readouterr().out
    assert "dropped line 2, which cannot be read" in said and "dropped line 3, which cannot be read" in said
    with pytest.raises(jsonl.BadLine, match=r"metrics.jsonl:2: "):
        jsonl.read_rows(path, strict=True)


def test_a_rewrite_replaces_the_file_whole_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "eval.jsonl"
    write(path, WHOLE + [{"step": 3}])
    before = os.stat(path).st_ino
    jsonl.rewrite(path, WHOLE)
    assert jsonl.read_rows(path) == WHOLE and path.read_text().endswith("\n")
    assert os.stat(path).st_ino != before  # a new file renamed over the old one, not the old one truncated in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.jsonl"]


def test_a_resumed_sink_keeps_the_checkpointed_steps_of_every_file_and_drops_torn_rows(tmp_path):
    """A run killed mid-write after step 3, resumed from its step-2 checkpoint: every file keeps steps 1-2 only,
    and the resumed run appends after them."""
    write(tmp_path / "metrics.jsonl", WHOLE + [{"step": 3, "loss": 0.1}], tail='{"step": 4, "loss"')
    write(tmp_path / "eval.jsonl", [{"step": 0, "acc": 0.1}, {"step": 2, "acc": 0.2}], tail='{"st')
    write(tmp_path / "completions.jsonl", [{"step": 2, "text": "a"}, {"step": 3, "text": "b"}])
    sink = MetricsSink(tmp_path, None, after_step=2)
    sink.log(3, {"loss": 0.125})
    sink.close()
    assert jsonl.read_rows(tmp_path / "metrics.jsonl") == [*WHOLE, {"step": 3, "loss": 0.125}]
    assert jsonl.read_rows(tmp_path / "eval.jsonl") == [{"step": 0, "acc": 0.1}, {"step": 2, "acc": 0.2}]
    assert jsonl.read_rows(tmp_path / "completions.jsonl") == [{"step": 2, "text": "a"}]
