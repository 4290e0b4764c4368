"""Weight sync: seconds and GB/s of each transport beside a bare broadcast of the same bytes, in one run.

    .venv/bin/python benchmarks/weight_sync.py [--sizes 30m 300m] [--repeats 3] [--ranks 1] [--zero-stage 3]
        [--bucket-mb 16] [--delta-steps 3]

For each Qwen2-shaped random-init model it starts a learner group and one generator (vLLM, weight transfer over
gloo on this machine) and times, from the driver, a full sync by each transport (`broadcast`, `object_store`), then
a bare gloo broadcast of the same number of bytes, in chunks of `sync.bucket_mb`, between the same two processes
(learner rank 0 and the generator): no gathering, packing or loading, the practical limit of the wire. It also
times `engine_load_only`: vLLM's in-place reload of the same weights already in the engine process's memory (what
any transport's receiving end must do). Prints one JSON line per (model, row) with `ratio` = bare seconds / row
seconds (1.0 would be the wire's speed), and for the broadcast transport `x_slower_of_wire_and_load` = its seconds
over the larger of the bare broadcast and the load alone (1.0: the sync fully overlaps the two).
Each figure is the median of `--repeats` syncs after one warm-up.

Delta sync (`--delta-steps` > 0) runs on a bf16 engine, as delta sync is meant to (the learner keeps fp32 weights and
its default learning rate): `broadcast_bf16` is a dense sync at that dtype, then for each of the steps the learner
trains one step on a small batch and `delta_step_k` times the delta sync that follows, with the fraction of
elements it sent as changed and `x_dense` = dense seconds / delta seconds. Run by hand; CI never runs it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import ray
import torch
from transformers import AutoConfig

from grpo_dist.cluster.actors.generator import Generator
from grpo_dist.cluster.learner_group import LearnerGroup
from grpo_dist.config import validate_config
from grpo_dist.models import build_tiny_model
from grpo_dist.transports import make_transport

SIZES = {
    "30m": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1536},
    "300m": {"hidden_size": 1024, "num_layers": 22, "num_heads": 16, "intermediate_size": 3072},
}


def config(model_dir: str, transport: str, args: argparse.Namespace, dtype: str = "float32", delta: bool = False):
    bucket = {} if args.bucket_mb is None else {"bucket_mb": args.bucket_mb}
    return {
        "model": {"path": model_dir},
        "data": {"task": {"name": "last_digit"}},
        "reward": {"functions": [{"name": "math_answer"}]},
        "algorithm": {"kl_coef": 0.0},
        "rollout": {"max_model_len": 64, "cpu_kv_cache_gib": 0.1, "dtype": dtype},
        "learner": {"num_ranks": args.ranks, "zero_stage": args.zero_stage, "micro_batch_size": 8},
        "sync": {"transport": transport, **bucket, "delta": delta, "full_every": 1000},
        "wandb": {"enabled": False},
    }


def training_batch(vocab: int, seed: int):
    """Two groups of 4 random completions with different rewards: one real GRPO step's worth of gradient."""
    from grpo_dist.algo import group_advantages
    from grpo_dist.algo.batch import collate
    from grpo_dist.types import Completion

    generator = torch.Generator().manual_seed(seed)
    completions = []
    for index in range(8):
        tokens = torch.randint(4, vocab, (24,), generator=generator).tolist()
        completions.append(Completion(index // 4, [10, 11, 12, 13], tokens, "", [-1.0] * 24, "stop", 0))
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.2])
    return collate(completions, group_advantages(rewards, 4), pad_token_id=0)


def sent_bytes(learner: LearnerGroup) -> tuple[int, int]:
    """(parameters, bytes a sync sends): every named parameter, tied ones under each name, at the learner's dtype."""

    def count(self):
        params = list(self.engine.module.named_parameters(remove_duplicate=False))
        shapes = [(getattr(p, "ds_shape", p.shape), p.dtype) for _, p in params]
        unique = {id(p): getattr(p, "ds_numel", p.numel()) for _, p in params}
        return sum(unique.values()), sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in shapes)

    return learner.call("__ray_call__", count)[0]


def bare_broadcast(rank: int, address: str, port: int, world: int, total: int, chunk: int) -> float:
    """Broadcast `total` bytes from rank 0 in chunks of `chunk`, one after another; seconds on this rank."""
    from grpo_dist.transports.gloo_wire import broadcast, open_group

    group = open_group(address, port, rank, world, 600)
    buffer = torch.ones(min(chunk, total), dtype=torch.uint8)
    broadcast(group, buffer).wait()  # warm-up
    started = time.perf_counter()
    for offset in range(0, total, chunk):
        broadcast(group, buffer[: min(chunk, total - offset)]).wait()
    return time.perf_counter() - started


def time_bare(learner: LearnerGroup, generator, total: int, chunk: int) -> float:
    (_, address), *_ = learner.call("node")
    port = learner.call("free_port")[0]
    sender = learner.ranks[0].__ray_call__.remote(lambda self: bare_broadcast(0, address, port, 2, total, chunk))
    receiver = generator.__ray_call__.remote(lambda self: bare_broadcast(1, address, port, 2, total, chunk))
    return max(ray.get([sender, receiver], timeout=1200))  # the wire alone: after the rendezvous and a warm-up


def time_load(learner: LearnerGroup, generator) -> float:
    """Seconds the engine takes to load weights already in its process's memory (the receiving end's own work)."""
    weights = ray.get(learner.state_dict(), timeout=1200)
    return ray.get(generator.load_weights.remote(weights, 0), timeout=1200)


def time_sync(transport, repeats: int) -> float:
    transport.sync(0)  # warm-up
    seconds = []
    for version in range(1, repeats + 1):
        started = time.perf_counter()
        transport.sync(version)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def measure(size: str, args: argparse.Namespace) -> None:
    model_dir = str(build_tiny_model(tempfile.mkdtemp(prefix=f"weight-sync-{size}-"), **SIZES[size]))
    cfg = validate_config(config(model_dir, "broadcast", args))
    learner = LearnerGroup.start(cfg, model_dir)
    generator = start_generator(model_dir, cfg)
    try:
        parameters, nbytes = sent_bytes(learner)
        chunk = int(cfg.sync.bucket_mb * 2**20)
        bare = statistics.median(time_bare(learner, generator, nbytes, chunk) for _ in range(args.repeats))
        load = statistics.median(time_load(learner, generator) for _ in range(args.repeats))
        rows = [("bare_gloo_broadcast", bare, {}), ("engine_load_only", load, {})]
        for name in ("broadcast", "object_store"):
            transport = make_transport(validate_config(config(model_dir, name, args)), learner, [generator])
            transport.connect()
            seconds = time_sync(transport, args.repeats)
            slower = {"x_slower_of_wire_and_load": round(seconds / max(bare, load), 3)} if name == "broadcast" else {}
            rows.append((name, seconds, slower))
        if args.delta_steps:
            ray.kill(generator)
            rows += measure_delta(model_dir, learner, args)
        for name, seconds, extra in rows:
            result = {
                "size": size, "parameters": parameters, "bytes": nbytes, "ranks": args.ranks,
                "zero_stage": args.zero_stage, "bucket_mb": cfg.sync.bucket_mb, "transport": name,
                "seconds": round(seconds, 4), "gb_per_s": round(nbytes / seconds / 1e9, 3),
                "ratio": round(bare / seconds, 3), **extra,
            }  # fmt: skip
            print(json.dumps(result), flush=True)
    finally:
        learner.shutdown()
        ray.kill(generator)


def start_generator(model_dir: str, cfg):
    generator = ray.remote(Generator).options(num_cpus=1).remote(model_dir, cfg.rollout, 0, "gloo")
    ray.get(generator.start.remote(), timeout=600)
    return generator


def measure_delta(model_dir: str, learner: LearnerGroup, args: argparse.Namespace) -> list:
    """Dense and delta syncs into a bf16 engine, the delta ones each after a real training step."""
    dense_cfg = validate_config(config(model_dir, "broadcast", args, dtype="bfloat16"))
    generator = start_generator(model_dir, dense_cfg)
    try:
        dense = make_transport(dense_cfg, learner, [generator])
        dense.connect()
        dense_seconds = time_sync(dense, args.repeats)
        rows = [("broadcast_bf16", dense_seconds, {})]
        transport = make_transport(validate_config(config(model_dir, "broadcast", args, "bfloat16", True)), learner,
                                   [generator])  # fmt: skip
        transport.connect()
        transport.sync(0)  # full: the engines' copies start here
        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        for step in range(1, args.delta_steps + 1):
            learner.train(training_batch(vocab, step))
            started = time.perf_counter()
            report = transport.sync(step)
            seconds = time.perf_counter() - started
            extra = {
                "changed_fraction": round(report.changed / report.elements, 4),
                "mode": report.mode,
                "sent_mb": round(report.sent_bytes / 2**20, 2),
                "x_dense": round(dense_seconds / seconds, 3),
            }
            rows.append((f"delta_step_{step}", seconds, extra))
        return rows
    finally:
        ray.kill(generator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["30m", "300m"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--zero-stage", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=None, help="default: sync.bucket_mb's")
    parser.add_argument("--delta-steps", type=int, default=3, help="training steps with a delta sync each (0: none)")
    args = parser.parse_args()
    ray.init(num_cpus=max(4, args.ranks + 2), include_dashboard=False, log_to_driver=False)
    for size in args.sizes:
        measure(size, args)
    ray.shutdown()


if __name__ == "__main__":
    main()
