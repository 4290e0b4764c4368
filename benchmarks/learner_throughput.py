"""Learner throughput of packed micro-batches against padded ones, side by side in one run.

    .venv/bin/python benchmarks/learner_throughput.py [--sizes 0.3m 30m] [--steps 3] [--rows 128]
        [--micro-batch-size 16] [--budget 4096] [--lengths benchmarks/data/agent_lengths.json]

Each size's model (the tiny Qwen2 of `grpo_dist.models`, random-init) trains on the same rollout batch four ways,
each in a process of its own (so each peak memory is its own): `padded` (`learner.packing: false`, micro-batches of
`--micro-batch-size` rows padded to the longest row, as before packing), `packed` (the same micro-batches packed),
`padded-large` (padded micro-batches of `--large-micro-batch-size` rows) and `packed+budget` (packed micro-batches
of at most `--budget` tokens, `learner.max_tokens_per_micro_batch`; by default about as many tokens as
`padded-large` holds without its padding). A
step is the learner's: the old log-prob pass is skipped (one epoch, one mini-batch), the reference pass runs
(`kl_coef` 0.04), then forward, loss, backward over every micro-batch and one AdamW step.

The batch's rows take their prompt and completion lengths from `--lengths`, drawn with replacement (seeded): by
default the 224 trajectories recorded from the agent task's GRPO run (`configs/agent.yaml`, seed 0; `--record
RUN_DIR --lengths FILE` writes such a file from any run directory). Token ids are random.

Prints one JSON line per size and way: trained tokens/s (every real token of the batch, prompt and
completion, per second of a step), seconds per step, the peak memory the step adds to the process (resident memory
on a CPU, the allocator's peak on a GPU), on a GPU the model FLOPs utilisation (`grpo_dist.algo.throughput`), and
`speedup` / `memory_ratio` against `padded` of the same size, and the largest difference between the packed and the
padded log-probs of the first micro-batch's counted tokens (0 for the padded ways).

It also measures the sampled tokens' log-prob and entropy selection alone at a real vocabulary (151,936 entries,
2,048 positions, forward and backward) as computed before packing (the full float32 log-softmax) and chunked
(`grpo_dist.algo.scoring.selected_logprobs`): one line with the peak memory each adds to the logits (their gradient
included) and time, and the ratios.

Runs by hand, here and on a GPU machine (it needs torch and transformers, not Ray or DeepSpeed); CI never runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from grpo_dist.algo import policy_loss, scoring  # noqa: E402
from grpo_dist.algo.batch import TrainBatch, collate, shard_batch  # noqa: E402
from grpo_dist.algo.throughput import flop_params, peak_flops, step_flops  # noqa: E402
from grpo_dist.types import Completion  # noqa: E402

SIZES = {  # as benchmarks/learner_scaling.py
    "0.3m": {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "intermediate_size": 256},
    "30m": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1536},
    "0.3b": {"hidden_size": 1024, "num_layers": 24, "num_heads": 16, "intermediate_size": 2816},  # for a GPU
}
WAYS = ("padded", "packed", "padded-large", "packed+budget")
VOCAB, POSITIONS = 151_936, 2_048  # the selection-alone measurement


def recorded_batch(path: Path, rows: int, seed: int = 0) -> TrainBatch:
    """`rows` sequences with (prompt, completion) lengths drawn from the recording at `path`, random token ids."""
    lengths = json.loads(path.read_text())["prompt_completion_tokens"]
    chooser, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    completions = []
    for index in range(rows):
        prompt, completion = chooser.choice(lengths)
        ids = torch.randint(4, 90, (prompt + completion,), generator=generator).tolist()
        logprobs = [-2.0] * completion
        completions.append(Completion(index // 8, ids[:prompt], ids[prompt:], "", logprobs, "stop", 0))
    advantages = torch.randn(rows, generator=generator)
    return collate(completions, advantages, pad_token_id=0)


def record(run_dir: Path, out: Path) -> None:
    """The (prompt, completion) token lengths of every row of `run_dir`'s completion table, to `out`. The bundled
    recording: `--record` on the run directory of `benchmarks/learning.py --config configs/agent.yaml` at seed 0."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    rows = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    pairs = [[len(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]), row["length"]] for row in rows]
    source = f"the completion table of {run_dir.name} ({len(pairs)} rows)"
    out.write_text(json.dumps({"source": source, "prompt_completion_tokens": pairs}))
    print(f"{len(pairs)} rows from {run_dir} to {out}")


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def run_way(args: argparse.Namespace) -> dict:
    """One way on one size, in this process: warm-up step, then `--steps` timed steps."""
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval().requires_grad_(False)
    packed = args.way.startswith("packed")
    if packed:
        scoring.use_packed_attention(policy)
        scoring.use_packed_attention(reference)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    batch = recorded_batch(args.lengths, args.rows)
    budget = args.budget if args.way == "packed+budget" else None
    rows = args.large_micro_batch_size if args.way == "padded-large" else args.micro_batch_size
    (shard,) = shard_batch(batch, 1, 1, rows, "seq-mean-token-mean", max_tokens=budget)
    on_device = shard.batch.to(device)
    micro_batches = shard.micro_batches_of(0)

    def step() -> None:
        with torch.no_grad():
            ref = torch.zeros(on_device.input_ids.shape, device=device)
            for rows, _ in micro_batches:
                ref[rows] = scoring.scores(reference, on_device.select(rows), 1.0, packed=packed,
                                           host=shard.batch.select(rows))[0]  # fmt: skip
        for rows, share in micro_batches:
            micro = on_device.select(rows)
            logprobs, entropy = scoring.scores(policy, micro, 1.0, entropy=True, packed=packed,
                                               host=shard.batch.select(rows))  # fmt: skip
            loss, _ = policy_loss(logprobs, logprobs.detach(), micro.advantages, micro.completion_mask,
                                  ref_logprobs=ref[rows], kl_coef=0.04, entropy=entropy)  # fmt: skip
            (loss * share).backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    with torch.no_grad():  # the packed scores against the padded ones, on the first micro-batch
        first = on_device.select(micro_batches[0][0])
        counted = first.completion_mask.clone()
        counted[:, 0] = 0
        difference = (scoring.scores(policy, first, 1.0, packed=packed)[0]
                      - scoring.scores(policy, first, 1.0, packed=False)[0]).abs()[counted != 0].max()  # fmt: skip
    step()  # warm-up: allocations, the optimizer's state
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = peak_bytes(device) if device.type == "cuda" else _resident()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = (time.perf_counter() - started) / args.steps
    lengths = batch.attention_mask.sum(dim=1).tolist()
    config = policy.config
    flops = step_flops(lengths, flop_params(policy), config.num_hidden_layers, config.hidden_size, 1, 1)
    result = {
        "size": args.size, "way": args.way, "parameters": sum(p.numel() for p in policy.parameters()),
        "rows": args.rows, "tokens": int(sum(lengths)), "padded_tokens": args.rows * int(max(lengths)),
        "micro_batches": len(micro_batches), "max_logprob_difference_to_padded": float(f"{difference:.2g}"),
        "s_per_step": round(seconds, 4),
        "tokens_per_s": round(sum(lengths) / seconds, 1),
        "step_peak_mb": round((peak_bytes(device) - (0 if device.type == "cuda" else before)) / 2**20, 1),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()}",
    }  # fmt: skip
    if device.type == "cuda":
        result["mfu"] = round(flops / seconds / peak_flops(torch.cuda.get_device_name(device), True), 4)
    return result


def _resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_selection(args: argparse.Namespace) -> dict:
    """The selection alone, one way, in this process: the memory its forward and backward add to the logits (the
    logits' gradient included)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(POSITIONS, VOCAB, device=device, generator=generator, requires_grad=True)
    targets = torch.randint(0, VOCAB, (POSITIONS,), device=device, generator=generator)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    before = peak_bytes(device) if device.type == "cuda" else _resident()
    started = time.perf_counter()
    if args.way == "full":
        log_probs = torch.log_softmax(logits.float(), dim=-1)  # as `token_logprobs_and_entropy` computes them
        logprobs = log_probs.gather(-1, targets[:, None]).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    else:
        logprobs, entropy = scoring.selected_logprobs(logits, targets, 1.0, entropy=True)
    (logprobs.sum() + 0.01 * entropy.sum()).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    logits_mb = logits.numel() * logits.element_size() / 2**20
    return {
        "selection": args.way, "positions": POSITIONS, "vocabulary": VOCAB, "logits_mb": round(logits_mb, 1),
        "peak_added_mb": round((peak_bytes(device) - before) / 2**20, 1), "seconds": round(seconds, 3),
    }  # fmt: skip


def child(arguments: list[str], script: str = __file__) -> dict:
    """The JSON line `script` run with `arguments` in a process of its own prints last."""
    done = subprocess.run([sys.executable, script, *arguments], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{Path(script).stem}: {' '.join(arguments)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["0.3m", "30m"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=128, help="sequences per batch (the agent task: 16 x 8)")
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--large-micro-batch-size", type=int, default=32, help="rows per micro-batch of padded-large")
    parser.add_argument("--budget", type=int, default=4096, help="tokens per micro-batch of packed+budget")
    parser.add_argument("--lengths", type=Path, default=REPO / "benchmarks" / "data" / "agent_lengths.json")
    parser.add_argument("--record", type=Path, metavar="RUN_DIR",
                        help="write --lengths from a run's completion table (its completions.jsonl and final/ "
                             "tokenizer) instead of measuring")  # fmt: skip
    parser.add_argument("--way", choices=[*WAYS, "full", "chunked"], help=argparse.SUPPRESS)  # a child's
    parser.add_argument("--size", choices=sorted(SIZES), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.record is not None:
        record(args.record, args.lengths)
        return
    if args.way in WAYS:
        print(json.dumps(run_way(args)))
        return
    if args.way is not None:
        print(json.dumps(run_selection(args)))
        return
    from grpo_dist.models import build_tiny_model

    common = ["--steps", str(args.steps), "--rows", str(args.rows), "--micro-batch-size", str(args.micro_batch_size),
              "--large-micro-batch-size", str(args.large_micro_batch_size), "--budget", str(args.budget),
              "--lengths", str(args.lengths)]  # fmt: skip
    for size in args.sizes:
        model = build_tiny_model(tempfile.mkdtemp(prefix=f"learner-throughput-{size}-"), **SIZES[size])
        baseline = None
        for way in WAYS:
            result = child([*common, "--way", way, "--size", size, "--model", str(model)])
            baseline = baseline or result
            result["speedup"] = round(result["tokens_per_s"] / baseline["tokens_per_s"], 3)
            result["memory_ratio"] = round(result["step_peak_mb"] / max(baseline["step_peak_mb"], 1e-9), 3)
            print(json.dumps(result), flush=True)
    full, chunked = (child(["--way", way]) for way in ("full", "chunked"))
    ratio = full["peak_added_mb"] / max(chunked["peak_added_mb"], 1e-9)
    speedup = full["seconds"] / chunked["seconds"]
    print(json.dumps({"full": full, "chunked": chunked, "memory_ratio_full_over_chunked": round(ratio, 2),
                      "speedup_chunked": round(speedup, 2)}))  # fmt: skip


if __name__ == "__main__":
    main()
