"""What an evaluation reports, from judged samples: accuracy, the unbiased pass@k, maj@k, lengths; the answers read
for majority voting; the eval-set settings refused before anything starts. And what the learner's model FLOPs are
counted as, and what the console shows of a step."""

from __future__ import annotations

import logging

import pytest
from conftest import small_config

from grpo_dist.algo.throughput import flop_params, forward_flops, peak_flops, step_flops, throughput_metrics
from grpo_dist.config import ConfigError, validate_config
from grpo_dist.run.evaluation import Sample, final_answer, majority_correct, pass_at_k, set_metrics
from grpo_dist.storage.console import Console, step_line


def test_pass_at_k_is_the_unbiased_estimate():
    # n = 4 samples, c = 1 correct: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6; pass@3 = 1 - 1/4; pass@4 = 1
    assert [pass_at_k(4, 1, k) for k in (1, 2, 3, 4)] == [0.25, 0.5, 0.75, 1.0]
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # C(3,2) / C(5,2)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0


def sample(correct: bool, answer: str | None = None, length: int = 3, truncated: bool = False) -> Sample:
    return Sample(correct, False, answer, length, truncated)


def test_a_sets_metrics_from_its_judged_groups():
    groups = [
        [sample(True, "5"), sample(False, "3"), sample(False, "3"), sample(False, "7")],  # majority 3: wrong
        [sample(True, "2"), sample(True, "2"), sample(False, "9", length=4, truncated=True), sample(False, None)],
    ]
    found = set_metrics("digits", 4, groups)
    assert found["eval/digits/accuracy"] == 3 / 8
    assert found["eval/digits/pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert found["eval/digits/pass@2"] == pytest.approx((0.5 + (1 - 1 / 6)) / 2)  # c=2: 1 - C(2,2)/C(4,2)
    assert found["eval/digits/pass@4"] == 1.0
    assert found["eval/digits/maj@4"] == 0.5  # the first group's majority (3) is wrong, the second's (2) right
    assert found["eval/digits/length_mean"] == (3 * 7 + 4) / 8
    assert found["eval/digits/truncated"] == 1 / 8
    assert "eval/digits/pass@5" not in found


def test_majority_takes_the_first_answer_to_reach_the_top_count_and_needs_an_answer():
    assert majority_correct([sample(False, "1"), sample(True, "2"), sample(True, "2"), sample(False, "1")]) is False
    assert majority_correct([sample(True, None), sample(True, None)]) is False
    assert majority_correct([sample(False, None), sample(True, "4")]) is True


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("first \\boxed{3}, then \\boxed{4}", "4"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),  # braces nested twice
        ("it costs 1,234 dollars", "1234"),
        ("7 3 9 then 5.", "5"),
        ("-2.5 or 3/4", "3/4"),
        ("no number here", None),
    ],
)
def test_the_answer_read_for_voting(text, answer):
    assert final_answer(text) == answer


def test_eval_sets_that_cannot_run_are_refused_naming_the_set(tmp_path):
    def check(sets):
        validate_config(small_config(tmp_path, eval={"sets": sets}))

    with pytest.raises(ConfigError, match="eval set sampled: k=4 samples at temperature 0"):
        check([{"name": "sampled", "k": 4}])
    with pytest.raises(ConfigError, match="given more than once: \\['a'\\]"):
        check([{"name": "a"}, {"name": "a", "temperature": 1.0, "k": 2}])
    with pytest.raises(ConfigError, match="eval.sets.0.name"):
        check([{"name": "has space"}])


def test_model_flops_are_counted_from_the_shape():
    # one sequence of 10 tokens, N = 1000, 2 layers of width 8: 2*1000*10 + 2*2*8*100 = 23200 per forward
    assert forward_flops([10], 1000, 2, 8) == 23200
    # two training passes (3 forwards each) and a reference forward
    assert step_flops([10, 10], 1000, 2, 8, passes=2, forwards=1) == 2 * 23200 * 7
    assert peak_flops("NVIDIA H100 80GB HBM3", bf16=True) == 989e12
    assert peak_flops("NVIDIA H100 PCIe", bf16=True) == 756e12 and peak_flops("NVIDIA L40", bf16=True) == 181e12
    assert peak_flops("NVIDIA L4", bf16=True) == 121e12 and peak_flops("NVIDIA A10G", bf16=True) == 0.0
    assert peak_flops("NVIDIA H100 80GB HBM3", bf16=False) == 0.0 and peak_flops(None, bf16=True) == 0.0
    found = throughput_metrics(
        {"tokens/generated": 100, "time/generate": 2, "tokens/trained": 300, "time/learner_busy": 3,
         "learner/flops": 6e12, "learner/peak_flops": 1e12},
        num_ranks=2,
    )  # fmt: skip
    assert found == {
        "throughput/generated_tokens_per_s": 50,
        "throughput/trained_tokens_per_s": 100,
        "throughput/learner_flops_per_s": 1e12,
        "throughput/mfu": 1.0,
    }


@pytest.mark.parametrize("tied", [True, False])
def test_the_flop_parameters_leave_out_the_embedding_lookup(tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=tied)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    # tied: the one matrix is the output projection too; untied: the input embedding's 100 x 64 is left out
    assert flop_params(model) == (total if tied else total - 100 * 64)


def test_a_step_is_one_line_and_library_logs_go_to_the_file(tmp_path, capsys):
    metrics = {"reward/mean": 0.5, "kl": 0.001, "tokens_per_s": 1234.4, "time/step": 2.06, "staleness/max": 1.0}
    assert (
        step_line(3, 100, metrics, staleness=True)
        == "step   3/100  reward 0.500  kl 0.0010  1234 tok/s  2.1 s  staleness 1"
    )
    console = Console(verbose=False)
    console.open(tmp_path)
    try:
        logging.getLogger("vllm").warning("a library warning")
        import warnings

        warnings.warn("a Python warning", UserWarning, stacklevel=1)
    finally:
        console.close()
    shown = capsys.readouterr()
    assert "a library warning" not in shown.out + shown.err and "a Python warning" not in shown.out + shown.err
    logged = (tmp_path / "verbose.log").read_text()
    assert "a library warning" in logged and "a Python warning" in logged
    console = Console(verbose=True)  # --verbose: on the console as well
    console.open(tmp_path)
    try:
        logging.getLogger("torch").warning("a verbose warning")
    finally:
        console.close()
    assert "a verbose warning" in capsys.readouterr().err
    assert "a verbose warning" in (tmp_path / "verbose.log").read_text()


def test_the_weights_flops_are_what_torch_counts_and_training_is_three_forwards():
    """torch's FLOP counter on a forward and a training pass of a small Qwen2 (its fused CPU attention kernel is
    not counted: the weights' matmuls are, which is what 2 N per token estimates; N also holds the biases and
    norms, a fraction of a percent here)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    input_ids = torch.randint(0, 512, (4, 64))  # [B, T]
    with FlopCounterMode(display=False) as forward:
        model(input_ids=input_ids)
    with FlopCounterMode(display=False) as training:
        model(input_ids=input_ids).logits.square().mean().backward()
    weights_only = forward_flops([64] * 4, flop_params(model), layers=0, hidden=128)  # no attention term
    assert weights_only == pytest.approx(forward.get_total_flops(), rel=0.01)
    assert training.get_total_flops() == 3 * forward.get_total_flops()
    assert step_flops([64] * 4, flop_params(model), 2, 128, passes=1, forwards=0) == 3 * forward_flops(
        [64] * 4, flop_params(model), 2, 128
    )


def test_grpo_dist_eval_builds_its_own_config_and_leaves_the_users_as_it_was(tmp_path):
    from grpo_dist.run.evaluation import eval_config

    cfg = validate_config(small_config(tmp_path, wandb={"enabled": True}, checkpoint={"dir": str(tmp_path / "c")}))
    before = cfg.model_dump()
    scratch = tmp_path / "scratch"
    policy = eval_config(cfg, str(scratch), str(tmp_path / "final"))
    assert cfg.model_dump() == before
    assert (policy.run_dir, policy.checkpoint.dir, policy.wandb.enabled) == (scratch / "test", None, False)
    assert (policy.model.path, policy.model.tiny) == (str(tmp_path / "final"), None)
    assert eval_config(cfg, str(scratch), None).model == cfg.model  # a checkpoint: the config's own model


@pytest.mark.parametrize("kind", ["missing", "not-a-checkpoint"])
def test_eval_of_a_checkpoint_that_is_not_there_names_its_own_flag(capfd, monkeypatch, tmp_path, kind):
    """`grpo-dist eval --checkpoint PATH` with nothing usable at PATH: one line naming --checkpoint (not --resume,
    which eval has not), exit 2, before any cluster starts; nothing left behind: not the log file eval names as it
    starts (removed where nothing was written to it), nor the warm process it started for its cluster."""
    import tempfile

    import yaml
    from conftest import REPO, cli_here

    temporary = tmp_path / "temporary"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(small_config(tmp_path)))
    target = tmp_path / "checkpoints" / "step-000002"
    if kind == "not-a-checkpoint":
        target.mkdir(parents=True)
        (target / "notes.txt").write_text("not a checkpoint")
    result = cli_here(capfd, "eval", str(config), "--checkpoint", str(target), cwd=REPO)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"--checkpoint: {target} is not a complete checkpoint" in result.stderr, result.stderr
    assert "--resume" not in result.stderr and "Traceback" not in result.stderr
    assert not result.started_ray
    assert "the libraries' and actors' output: " + str(temporary) in result.stdout  # where it would have gone
    assert not list(temporary.iterdir())
    assert not warm_processes_started_here()  # the one it started for its cluster, stopped with the command


def warm_processes_started_here() -> list[int]:
    """The warm processes (`grpo_dist.cluster.warm`) this process started and that still run, but the session's."""
    import psutil
    from conftest import session_warm_pid

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "grpo_dist.cluster.warm" in child.cmdline() and child.pid != session_warm_pid():
                found.append(child.pid)
        except psutil.Error:
            pass
    return found


def test_eval_runs_with_no_injected_fault_and_injections_alone_rebuild_no_reward_worker(tmp_path):
    """`grpo-dist eval` of a rehearsal config (`faults.inject`) injects nothing, the rest of its fault settings kept;
    and two configs that differ only in what they inject build the reward pool (and teachers) alike."""
    from grpo_dist.cluster.cluster import reward_settings
    from grpo_dist.config import InjectConfig
    from grpo_dist.run.evaluation import eval_config

    raw = small_config(tmp_path, faults={"score_timeout_s": 9.0, "inject": {"drop_weights": [{"version": 2}]}})
    rehearsal = validate_config(raw)
    evaluated = eval_config(rehearsal, str(tmp_path / "scratch"), None)
    assert evaluated.faults.inject == InjectConfig() and evaluated.faults.score_timeout_s == 9.0
    assert rehearsal.faults.inject.drop_weights[0].version == 2  # the user's config left as it was
    plain = validate_config({**raw, "faults": {"score_timeout_s": 9.0}})
    assert reward_settings(plain) == reward_settings(rehearsal)
    assert reward_settings(plain) != reward_settings(validate_config({**raw, "faults": {"score_timeout_s": 8.0}}))
