"""LoRA served as an adapter against full weights, side by side in one run: what a sync sends and how long it takes,
and the engine's generation speed with the adapter against the merged model.

    .venv/bin/python benchmarks/lora_serving.py [--sizes 30m 300m] [--repeats 3] [--rank 16] [--prompts 16]
        [--group 4] [--tokens 64]

For each Qwen2-shaped random-init model (`benchmarks/weight_sync.py`'s sizes) it starts two learner groups on one
rank: `full` (every weight trained, synced by the broadcast transport over gloo) and `lora` (`learner.lora` at
`--rank` on the seven default modules, `serve: adapter`, synced by the adapter transport through Ray's object store),
trains each one step on the same batch (so the adapter is not zero), then times the median of `--repeats` syncs
into a generator after one warm-up. Then generation: one engine serving that adapter in its LoRA slots, and one
engine with the same policy merged into its weights (`learner.lora.serve: merged`'s sync), each generating the same
`--prompts` x `--group` completions of up to `--tokens` tokens (seeded: the same ones where the two policies agree),
one engine at a time; generated tokens/s, the median of `--repeats` rounds after a warm-up.

Prints one JSON line per size and row, then a `ratios` line per size: `sync_bytes` and `sync_seconds` (lora over
full) and `generation` (adapter tokens/s over merged tokens/s). Run by hand; CI never runs it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))

from weight_sync import SIZES, config, sent_bytes, training_batch  # noqa: E402

from grpo_dist.cluster.actors.generator import Generator  # noqa: E402
from grpo_dist.cluster.learner_group import LearnerGroup  # noqa: E402
from grpo_dist.config import validate_config  # noqa: E402
from grpo_dist.models import build_tiny_model  # noqa: E402
from grpo_dist.transports import adapter_slots, make_transport  # noqa: E402
from grpo_dist.types import Sampling  # noqa: E402


def settings(model_dir: str, args: argparse.Namespace, lora: dict | None):
    raw = config(model_dir, "broadcast", argparse.Namespace(ranks=1, zero_stage=2, bucket_mb=None))
    raw["learner"] = {**raw["learner"], "lr": 1e-2, "lora": lora}
    raw["rollout"] = {**raw["rollout"], "max_model_len": 16 + args.tokens, "cpu_kv_cache_gib": 0.5}
    return validate_config(raw)


def start_generator(model_dir: str, cfg, wire: str | None):
    generator = ray.remote(Generator).options(num_cpus=1)
    generator = generator.remote(model_dir, cfg.rollout, 0, wire, None, ("best_effort", []), adapter_slots(cfg))
    ray.get(generator.start.remote(), timeout=600)
    return generator


def time_sync(transport, repeats: int) -> tuple[float, int]:
    """Median seconds of `repeats` syncs after a warm-up, and the bytes the last one sent (where reported)."""
    transport.sync(1)
    seconds, report = [], None
    for version in range(2, repeats + 2):
        started = time.perf_counter()
        report = transport.sync(version)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), report.sent_bytes if report is not None else 0


def tokens_per_s(generator, args: argparse.Namespace) -> float:
    """Median tokens/s of `--repeats` rounds of `--prompts` groups of `--group` completions of `--tokens` tokens."""
    prompts = [[10 + index, 11, 12, 13, 14, 15, 16, 17] for index in range(args.prompts)]

    sampling = Sampling(temperature=1.0, top_p=1.0, max_tokens=args.tokens)

    def one_round() -> float:
        started = time.perf_counter()
        calls = [generator.generate.remote(prompt, args.group, sampling, i, i) for i, prompt in enumerate(prompts)]
        tokens = sum(len(completion.token_ids) for group in ray.get(calls, timeout=1200) for completion in group)
        return tokens / (time.perf_counter() - started)

    one_round()  # warm-up
    return statistics.median(one_round() for _ in range(args.repeats))


def measure(size: str, args: argparse.Namespace) -> None:
    model_dir = str(build_tiny_model(tempfile.mkdtemp(prefix=f"lora-serving-{size}-"), **SIZES[size]))
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    rows = []
    lora = {"rank": args.rank, "alpha": 2.0 * args.rank}
    for way, adapter in (("full", None), ("lora", lora)):
        cfg = settings(model_dir, args, adapter)
        learner = LearnerGroup.start(cfg, model_dir)
        generator = start_generator(model_dir, cfg, None if adapter else "gloo")
        try:
            learner.train(training_batch(vocab, 1))
            transport = make_transport(cfg, learner, [generator])
            transport.connect()
            seconds, sent = time_sync(transport, args.repeats)
            if not sent:
                sent = sent_bytes(learner)[1]
            rows.append({"size": size, "row": f"sync_{way}", "seconds": round(seconds, 4), "sent_mb": sent / 2**20})
            if adapter:
                rows.append({"size": size, "row": "generate_adapter", "tokens_per_s": tokens_per_s(generator, args)})
                ray.kill(generator)
                merged_cfg = settings(model_dir, args, {**lora, "serve": "merged"})
                generator = start_generator(model_dir, merged_cfg, None)
                ray.get(generator.load_weights.remote(learner.state_dict(), 1), timeout=1200)
                rows.append({"size": size, "row": "generate_merged", "tokens_per_s": tokens_per_s(generator, args)})
        finally:
            learner.shutdown()
            ray.kill(generator)
    for row in rows:
        print(json.dumps(row), flush=True)
    by = {row["row"]: row for row in rows}
    ratios = {
        "size": size,
        "row": "ratios",
        "sync_bytes": round(by["sync_lora"]["sent_mb"] / by["sync_full"]["sent_mb"], 4),
        "sync_seconds": round(by["sync_lora"]["seconds"] / by["sync_full"]["seconds"], 3),
        "generation": round(by["generate_adapter"]["tokens_per_s"] / by["generate_merged"]["tokens_per_s"], 3),
    }
    print(json.dumps(ratios), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["30m", "300m"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    ray.init(include_dashboard=False)
    try:
        for size in args.sizes:
            measure(size, args)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
