"""Each ready config in configs/ runs a few steps of the real loop, shrunk to a tiny model on a CPU, and its metrics
show the settings that make it that recipe; each recipe's signature fails on the other recipes' metrics."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

GROUP_SIZE = 4
SHRINK = [
    "run.steps=2",
    "data.eval_path=null",
    "data.max_prompt_tokens=16",
    "data.prompts_per_step=4",
    "rollout.num_generators=1",
    "rollout.num_gpus=0",
    "rollout.tensor_parallel_size=1",
    f"rollout.group_size={GROUP_SIZE}",
    "rollout.max_new_tokens=4",
    "rollout.max_model_len=32",
    "rollout.dtype=float32",
    "rollout.cpu_kv_cache_gib=0.05",
    "reward.num_workers=1",
    "reward.functions=[{name: reward_fixtures.first_char_reward}]",  # rewards in [0, 0.9], steps of 0.1
    "learner.num_gpus=0",
    "learner.num_ranks=1",
    "learner.offload=none",
    "learner.micro_batch_size=8",
    "learner.lr=1e-3",
    "wandb.enabled=false",
    "checkpoint.every_steps=0",  # what is checked is in the metrics: no checkpoint, no final policy written
    "run.save_final=false",
]
EXTRA = {"dapo": ["algorithm.overlong_buffer=2", "algorithm.max_sampling_rounds=2"]}
# The largest spread (max - min) of the ratio over one sequence's tokens: 0 exactly when the ratio is per sequence.
SEQUENCE_SPREAD = "ratio/sequence_spread"

# --- what the metrics of a run show -----------------------------------------------------------------------------

Row = dict[str, float]
Check = tuple[str, Callable[[list[Row]], bool]]


def every(predicate: Callable[[Row], bool]) -> Callable[[list[Row]], bool]:
    return lambda rows: all(predicate(row) for row in rows)


def std_normalised(row: Row) -> bool:
    """Advantages (r - group mean) / group std: an informative group (n >= 2 valid rewards, not all equal) has
    z-scores of sample std 1, so population variance (n - 1) / n >= 1/2, and a set of values with variance v spans
    at least 2 * sqrt(v) (Popoviciu): at least sqrt(2) = 1.414 (eps 1e-6 shrinks it by far less than 1e-3)."""
    return row["advantage/max"] - row["advantage/min"] >= math.sqrt(2) - 1e-3


def raw_deviations(row: Row) -> bool:
    """Advantages r - group mean (Dr. GRPO, no std division), some non-zero. r - mean = (n - 1) / n * (r - mean of
    the others), so |r - mean| <= (G - 1) / G * R, R the batch's reward spread. first_char_reward gives R <= 0.9:
    every advantage within 0.675, all of them spanning at most 1.35 < sqrt(2). So z-scores (`std_normalised`, at
    least 0.707 from 0 and spanning sqrt(2)) fail this check, and advantages that pass it fail that one."""
    bound = (GROUP_SIZE - 1) / GROUP_SIZE * (row["reward/max"] - row["reward/min"]) + 1e-6
    return row["advantage/max"] > 0 and max(row["advantage/max"], -row["advantage/min"]) <= bound


def no_kl_term(row: Row) -> bool:
    """kl_coef 0: the reference is never loaded (no `kl` logged) and the loss is the policy loss alone."""
    return "kl" not in row and row["loss"] == pytest.approx(row["loss/policy"], rel=1e-6, abs=1e-12)


def kl_term_in_loss(kl_coef: float) -> Callable[[Row], bool]:
    """The loss is the policy loss plus kl_coef * kl (entropy_coef is 0)."""
    return lambda row: row["loss"] - row["loss/policy"] == pytest.approx(kl_coef * row["kl"], rel=1e-3, abs=1e-9)


def kl_coef_of(name: str) -> float:
    from grpo_dist.config import load_config

    return load_config(REPO / "configs" / f"{name}.yaml").algorithm.kl_coef


# Each recipe's checks, in order; the first that fails says what did not show.
SIGNATURES: dict[str, list[Check]] = {
    "grpo": [
        ("kl logged every step (the reference is loaded only when kl_coef > 0)", every(lambda row: "kl" in row)),
        ("loss = policy loss + kl_coef * kl (grpo.yaml's 0.04)", every(kl_term_in_loss(kl_coef_of("grpo")))),
        ("kl 0 at step 1 (the policy is the reference)", lambda rows: abs(rows[0]["kl"]) <= 1e-6),
        ("kl > 1e-3 at step 2, after one Adam step at lr 1e-3 (measured: 0.045)", lambda rows: rows[1]["kl"] > 1e-3),
        ("advantages divided by the group std", every(std_normalised)),
        ("one update per batch: the ratio is exactly 1", every(lambda row: row["ratio/mean"] == 1.0)),
    ],
    "dapo": [
        ("dynamic sampling logged every step", every(lambda row: "dynamic_sampling/dropped_fraction" in row)),
        # overlong_buffer 2 of max_new_tokens 4: a completion of 3 or 4 tokens loses 0.5 or 1 (nearly all have 4)
        (
            "soft overlong penalty: the shaped mean reward is below the mean reward",
            every(lambda row: row["reward/shaped_mean"] < row["reward/mean"]),
        ),
        ("no KL term", every(no_kl_term)),
        ("advantages divided by the group std", every(std_normalised)),
    ],
    "dr_grpo": [
        ("no KL term", every(no_kl_term)),
        ("advantages are rewards minus the group mean, not divided by the group std", every(raw_deviations)),
    ],
    "gspo": [
        ("no KL term", every(no_kl_term)),
        ("advantages divided by the group std", every(std_normalised)),
        (
            "4 mini-batches: the policy moves within a step, so the ratio is not 1",
            every(lambda row: row["ratio/mean"] != 1.0),
        ),
        (
            "the ratio is per sequence: one value over each sequence's tokens",
            every(lambda row: row[SEQUENCE_SPREAD] == 0.0),
        ),
    ],
}
# Not visible in these metrics: DAPO's clip-higher (0.28) and token-mean aggregation, Dr. GRPO's
# seq-mean-token-sum-norm aggregation (every completion here has max_new_tokens tokens, where it equals the mean).


def first_mismatch(name: str, rows: list[Row]) -> str | None:
    """The first check of recipe `name`'s signature that `rows` fail, or None when they show all of it."""
    return next((what for what, check in SIGNATURES[name] if not check(rows)), None)


# --- the runs -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def train_path(tmp_path_factory) -> str:
    from grpo_dist.data import split_task

    root = tmp_path_factory.mktemp("recipes")
    return str(split_task("last_digit", root / "data", num_train=32, num_eval=4, seed=0)[0])


@pytest.fixture(scope="module")
def recipe_rows(shared_actors, train_path, tmp_path_factory) -> Callable[[str], list[Row]]:
    """`recipe_rows(name)`: the metrics.jsonl rows of configs/<name>.yaml, shrunk; each recipe runs once per module,
    all on the shared actors (the recipes differ in their algorithm, not in their actors, once shrunk)."""
    from grpo_dist.config import load_config
    from grpo_dist.models import build_tiny_model
    from grpo_dist.run.driver import train

    model_path = str(build_tiny_model(shared_actors.model_path))
    done: dict[str, list[Row]] = {}

    def run(name: str) -> list[Row]:
        if name not in done:
            output_dir = tmp_path_factory.mktemp(name)
            paths = [f"model.path={model_path}", f"data.path={train_path}", f"run.output_dir={output_dir}"]
            overrides = [*SHRINK, *EXTRA.get(name, []), *paths]
            cfg = load_config(REPO / "configs" / f"{name}.yaml", overrides)
            with shared_actors.use(cfg) as cluster:
                run_dir = train(cfg, cluster)
            done[name] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return done[name]

    return run


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_recipe_runs_and_shows_its_signature(recipe_rows, name):
    rows = recipe_rows(name)
    assert [row["step"] for row in rows] == [1, 2]
    assert all(math.isfinite(row["loss"]) for row in rows)
    assert first_mismatch(name, rows) is None, f"{name}: {first_mismatch(name, rows)}; rows: {rows}"


@pytest.mark.parametrize(
    ("signature", "other"),
    [
        pytest.param(signature, other, id=f"{signature}-signature-on-{other}-rows")
        for signature in sorted(SIGNATURES)
        for other in sorted(SIGNATURES)
        if other != signature
    ],
)
def test_a_signature_fails_on_the_other_recipes(recipe_rows, signature, other):
    """The rows of the runs above, no extra run: hand-written rows would only restate the checks. What should tell
    each pair apart: grpo's kl; dapo's dynamic sampling; dr_grpo's raw advantages against the others' z-scores
    (see `raw_deviations`); gspo's z-scores against dr_grpo, its kl against grpo, its per-sequence ratio against
    dapo (whose 16 mini-batches also move the ratio off 1)."""
    assert first_mismatch(signature, recipe_rows(other)) is not None, f"{other}'s rows pass the {signature} signature"
