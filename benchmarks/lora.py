"""The learner's step with a LoRA adapter against full fine-tuning, side by side in one run.

    .venv/bin/python benchmarks/lora.py [--sizes 30m 0.3b] [--steps 3] [--rows 64] [--budget 4096] [--rank 16]

Each size's model (the tiny Qwen2 of `grpo_dist.models`, random-init: "30m" has 27M parameters, "0.3b" 308M) trains
on the same rollout batch two ways, each in a process of its own (so each peak memory is its own): `full` (every
weight trained; the reference a second, frozen copy, as the learner holds it under ZeRO 0-2) and `lora`
(`grpo_dist.models.lora.wrap` with `--rank` on the seven default modules, alpha twice the rank; the reference the policy
with its adapter off). A step is the learner's: the reference pass (`kl_coef` 0.04), then forward, loss and
backward over packed micro-batches of at most `--budget` tokens, and one AdamW step. The batch's rows take their
lengths from the agent task's recorded trajectories (`benchmarks/learner_throughput.py`), token ids random.

Prints one JSON line per size and way: seconds per step, trained tokens/s, the parameters the optimizer holds and
the bytes of its state, and the peak memory of the whole process (the allocator's peak on a GPU; resident memory on
a CPU, Python and torch included), then `speedup` and `memory_ratio` against `full` of the same size.

Runs by hand, here and on a GPU machine (it needs torch, transformers and peft, not Ray or DeepSpeed); CI never
runs it. With a GPU the models train in bf16 (the adapter and the reference too), without in float32. The AdamW
here keeps its state in the parameters' dtype; the learner under DeepSpeed's bf16 keeps fp32 master weights and
moments (12 bytes more per trained parameter), so its saving with LoRA is larger than this one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from learner_throughput import SIZES, child, peak_bytes, recorded_batch  # noqa: E402

from grpo_dist.algo import policy_loss, scoring  # noqa: E402
from grpo_dist.algo.batch import shard_batch  # noqa: E402
from grpo_dist.config.sections import LoraConfig  # noqa: E402
from grpo_dist.models import lora  # noqa: E402

WAYS = ("full", "lora")
LENGTHS = REPO / "benchmarks" / "data" / "agent_lengths.json"


def models(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """The policy, what scores the reference, and the parameters the optimizer steps."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    scoring.use_packed_attention(policy)
    if args.way == "lora":
        policy = lora.wrap(policy, LoraConfig(rank=args.rank, alpha=2.0 * args.rank)).to(device, dtype)  # PEFT: fp32
        return policy, lora.AdapterOff(policy), [param for param in policy.parameters() if param.requires_grad]
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval().requires_grad_(False)
    scoring.use_packed_attention(reference)
    return policy.to(device), reference.to(device), list(policy.parameters())


def run_way(args: argparse.Namespace) -> dict:
    """One way on one size, in this process: a warm-up step, then `--steps` timed steps."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    policy, reference, trained = models(args, device, dtype)
    optimizer = torch.optim.AdamW(trained, lr=1e-5)
    batch = recorded_batch(LENGTHS, args.rows)
    (shard,) = shard_batch(batch, 1, 1, args.rows, "seq-mean-token-mean", max_tokens=args.budget)
    on_device, micro_batches = shard.batch.to(device), shard.micro_batches_of(0)

    def step() -> None:
        with torch.no_grad():
            ref = torch.zeros(on_device.input_ids.shape, device=device)  # [b, T]
            for rows, _ in micro_batches:
                host = shard.batch.select(rows)
                ref[rows] = scoring.scores(reference, on_device.select(rows), 1.0, packed=True, host=host)[0]
        for rows, share in micro_batches:
            micro = on_device.select(rows)
            host = shard.batch.select(rows)
            logprobs, entropy = scoring.scores(policy, micro, 1.0, entropy=True, packed=True, host=host)  # [b, T]
            loss, _ = policy_loss(
                logprobs, logprobs.detach(), micro.advantages, micro.completion_mask, ref_logprobs=ref[rows],
                kl_coef=0.04, entropy=entropy,
            )  # fmt: skip
            (loss * share).backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up: allocations, the optimizer's state
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = (time.perf_counter() - started) / args.steps
    tokens = int(batch.attention_mask.sum())
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim())
    return {
        "size": args.size, "way": args.way, "parameters": sum(p.numel() for p in policy.parameters()),
        "trained_parameters": sum(p.numel() for p in trained), "optimizer_state_mb": round(state / 2**20, 1),
        "rows": args.rows, "tokens": tokens, "micro_batches": len(micro_batches), "s_per_step": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 1), "peak_mb": round(peak_bytes(device) / 2**20, 1),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()}",
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=["30m", "0.3b"], default=["30m"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--budget", type=int, default=4096, help="tokens per packed micro-batch")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # a child's
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.way is not None:
        print(json.dumps(run_way(args)))
        return
    from grpo_dist.models import build_tiny_model

    common = ["--steps", str(args.steps), "--rows", str(args.rows), "--budget", str(args.budget),
              "--rank", str(args.rank)]  # fmt: skip
    for size in args.sizes:
        model = build_tiny_model(tempfile.mkdtemp(prefix=f"lora-{size}-"), **SIZES[size])
        baseline = None
        for way in WAYS:
            result = child([*common, "--way", way, "--size", size, "--model", str(model)], __file__)
            baseline = baseline or result
            result["speedup"] = round(baseline["s_per_step"] / result["s_per_step"], 3)
            result["memory_ratio"] = round(result["peak_mb"] / baseline["peak_mb"], 3)
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
