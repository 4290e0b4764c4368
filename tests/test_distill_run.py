"""On-policy distillation end to end: a teacher made here (the tiny model warmed up on solved rows by `grpo-dist
sft`), served by a teacher engine on Ray, scores every token a random-init student samples; the student's learner
trains on the per-token advantages alone. Asynchronous generation (max_staleness 1), packed micro-batches and the
token-mean aggregation are on, so they are tried with it too."""

from __future__ import annotations

import json

import pytest
from conftest import small_config, train_here

from grpo_dist.config import validate_config
from grpo_dist.run.inputs import load_tokenizer
from grpo_dist.run.sft import run_sft

pytestmark = pytest.mark.slow

TASK = {"task": {"name": "last_digit", "num_train": 512, "num_eval": 50}, "max_prompt_tokens": 16}
CHARACTERS = {"characters": "0123456789 :"}  # the student's and the teacher's tokenizer: the task's alphabet


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    """The student's random-init model (the same tiny config and seed), warmed up on solved rows: nearly always
    right (`test_sft.py`)."""
    tmp_path = tmp_path_factory.mktemp("teacher")
    raw = small_config(
        tmp_path,
        data=TASK,
        rollout={"max_new_tokens": 2},
        eval={"max_prompts": 50},
        sft={"base": str(tmp_path / "teacher-base"), "steps": 150, "batch_size": 32, "lr": 3e-3},
    )
    raw["model"] = {"path": str(tmp_path / "teacher"), "tiny": CHARACTERS}
    return str(run_sft(validate_config(raw)))


def test_a_student_distilled_on_its_own_samples_nears_its_teacher_and_learns_the_task(
    tmp_path, capfd, ray_cluster, teacher
):
    raw = small_config(
        tmp_path,
        run={"steps": 30},
        data={**TASK, "prompts_per_step": 32},
        rollout={"group_size": 16, "max_new_tokens": 2, "max_model_len": 32, "max_staleness": 1},
        algorithm={"kl_coef": 0.0, "aggregation": "token-mean", "distill": {"teacher": teacher, "coef": 1.0}},
        learner={"lr": 1e-3, "micro_batch_size": 512, "zero_stage": 0, "packing": True},
        eval={"max_prompts": 50},
        checkpoint={"every_steps": 0},
    )
    raw["model"] = {"path": str(tmp_path / "student"), "tiny": CHARACTERS}
    raw["reward"]["functions"] = [
        {"name": "regex_format", "weight": 0.2, "kwargs": {"pattern": "[0-9]"}},
        {"name": "math_answer", "weight": 0.8},
    ]
    config = tmp_path / "distill.yaml"
    config.write_text(json.dumps(raw))
    code, output = train_here(capfd, config)
    assert code == 0, output[-3000:]
    assert "1 teacher engine(s) (vLLM)" in output

    run_dir = tmp_path / "outputs" / "test"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "distill/reverse_kl" in row]
    assert [row["step"] for row in steps] == list(range(1, 31))
    kl = [row["distill/reverse_kl"] for row in steps]
    first, last = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    accuracy = {row["step"]: row["eval/held_out/accuracy"] for row in evals}
    print(f"reverse KL to the teacher, first 3 steps {first:.3f}, last 3 {last:.3f}; held-out accuracy {accuracy}")
    assert last < 0.5 * first  # the student moved toward the teacher
    assert accuracy[30] >= accuracy[0] + 0.3  # and learned the task from it alone
    # Drawn ahead, a batch is scored while the step before it trains, and counted there: the last step draws none.
    assert all(row["distill/teacher_seconds"] > 0 for row in steps[:-1])
    assert steps[-1]["distill/unscored"] == 0 and steps[-1]["faults/teacher_restarts"] == 0
    assert all(row["staleness/max"] <= 1 for row in steps)


def test_a_sequence_filling_the_context_gets_the_teacher_models_log_prob_at_every_token(tmp_path, ray_cluster, teacher):
    """A completion whose prompt and tokens fill all of `rollout.max_model_len`, as a trajectory cut at
    `environment.max_total_tokens` can: vLLM reads a prompt of at most its engine's length less one, so the teacher's
    engine holds one position more than the generators'. Every token gets the teacher's log-prob after the tokens
    before it, equal to the teacher model's own under transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_dist.cluster.placement import place
    from grpo_dist.cluster.teacher_pool import TeacherPool
    from grpo_dist.faults import FaultLog
    from grpo_dist.types import Completion

    data = {**TASK, "max_prompt_tokens": 8}
    raw = small_config(tmp_path, data=data, rollout={"max_new_tokens": 3, "max_model_len": 11})
    raw["algorithm"]["distill"] = {"teacher": teacher}
    raw["model"] = {"path": teacher, "tiny": CHARACTERS}
    config = validate_config(raw)
    sequence = load_tokenizer(teacher)("1 2 3 4:444", add_special_tokens=False)["input_ids"]
    assert len(sequence) == 11  # the right answer, then twice a token the teacher does not expect after it
    completion = Completion(0, sequence[:8], sequence[8:], "444", [0.0] * 3, "length", 0)
    placement = place(config)
    pool = TeacherPool(config, placement, FaultLog())
    try:
        pool.pool.wait_ready()
        pool.annotate([completion])
    finally:
        pool.shutdown()
        placement.remove()
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0].log_softmax(-1)  # [11, V]
    expected = [float(logits[at - 1, sequence[at]]) for at in (8, 9, 10)]
    print(f"teacher log-probs {completion.teacher_logprobs}, transformers {expected}")
    assert completion.teacher_logprobs == pytest.approx(expected, abs=1e-3)
    assert expected[0] > -0.5 > -3 > expected[1]
