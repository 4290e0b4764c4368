"""Weight transports with the real stack: 2 learner ranks under ZeRO-3 (DeepSpeed on gloo) syncing 2 vLLM
generators, by broadcast over gloo and by the object store; and the bucket plan both ends of a broadcast share."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import small_config

from grpo_dist.config import validate_config

TRANSPORTS = ("broadcast", "object_store")


def test_buckets_hold_whole_layers_every_byte_once_aligned_and_within_size():
    from grpo_dist.transports.delta import ALIGN
    from grpo_dist.transports.gloo_wire import ParamMeta, plan_buckets

    params = [
        ParamMeta("embed.weight", torch.float32, (3, 5)),  # 60 bytes, before the layers
        ParamMeta("layers.0.a", torch.bfloat16, (7,)),  # layer 0: 14 + 40 bytes
        ParamMeta("layers.0.b", torch.float32, (10,)),
        ParamMeta("layers.1.big", torch.float32, (100,)),  # layer 1: larger than a bucket, a bucket of its own
        ParamMeta("layers.2.c", torch.int64, (2, 2)),  # layer 2: 32 + 18 bytes
        ParamMeta("layers.2.d", torch.float16, (9,)),
        ParamMeta("norm.weight", torch.float32, (4,)),  # after the layers
    ]
    buckets = plan_buckets(params, bucket_bytes=192)
    # 64 (embed) + 128 (layer 0, two aligned slots) = 192 fits; layer 1 alone; layer 2 (128) + norm (64) = 192.
    assert [[slot.name for slot in bucket.slots] for bucket in buckets] == [
        ["embed.weight", "layers.0.a", "layers.0.b"],
        ["layers.1.big"],
        ["layers.2.c", "layers.2.d", "norm.weight"],
    ]
    assert [[slot.layer for slot in bucket.slots] for bucket in buckets] == [[0, 1, 1], [2], [3, 3, 4]]
    for bucket in buckets:
        assert bucket.nbytes <= 192 or len({slot.layer for slot in bucket.slots}) == 1
        assert all(slot.offset % ALIGN == 0 for slot in bucket.slots) and bucket.nbytes % ALIGN == 0
        ends = [slot.offset + slot.nbytes for slot in bucket.slots]
        assert all(end <= after.offset for end, after in zip(ends[:-1], bucket.slots[1:], strict=True)), "overlap"
        assert ends[-1] <= bucket.nbytes < ends[-1] + ALIGN


def test_layers_group_by_their_first_index_whatever_the_architecture_and_order():
    """A sync cuts the parameters into decoder layers by the first numeric part of each name, as vLLM's own
    trainer engines do: the names before the first layer, each stack's layers in ascending index (stacks in the
    order their prefix first appears), then every other name, however the module listed them."""
    from grpo_dist.transports.gloo_wire import layer_groups

    names = ["model.embed_tokens.weight", "model.layers.10.mlp.w", "model.layers.2.attn.q", "model.norm.weight",
             "model.layers.2.mlp.w", "visual.blocks.0.attn", "lm_head.weight", "model.layers.10.attn.q"]  # fmt: skip
    assert layer_groups(names) == [
        ["model.embed_tokens.weight"],
        ["model.layers.2.attn.q", "model.layers.2.mlp.w"],
        ["model.layers.10.mlp.w", "model.layers.10.attn.q"],
        ["visual.blocks.0.attn"],
        ["model.norm.weight", "lm_head.weight"],
    ]
    assert layer_groups(["transformer.h.1.a", "transformer.wte", "transformer.h.0.a"]) == [
        ["transformer.h.0.a"], ["transformer.h.1.a"], ["transformer.wte"]]  # fmt: skip
    assert layer_groups(["a.weight", "b.weight"]) == [["a.weight", "b.weight"]]


def test_the_learners_side_of_a_sync_imports_no_vllm():
    """The learner sends over gloo with vLLM's protocol written without vLLM's types: importing vLLM was 5 of a
    learner's 9 CPU-seconds of start-up. (tests/test_loop.py checks the ranks of a real run after their syncs.)"""
    import subprocess
    import sys

    modules = "grpo_dist.cluster.actors.learner, grpo_dist.transports.broadcast, grpo_dist.transports.gloo_sender"
    code = f"import sys, {modules}; print(sorted(name for name in sys.modules if name.split('.')[0] == 'vllm'))"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert found.strip() == "[]", found


def test_packed_bucket_unpacks_to_the_same_tensors():
    from grpo_dist.transports.gloo_wire import ParamMeta, pack, plan_buckets, unpack

    tensors = {"w": torch.randn(4, 3), "h": torch.randn(5).to(torch.bfloat16), "i": torch.arange(3)}
    params = [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    (bucket,) = plan_buckets(params, bucket_bytes=1024)
    buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    pack(buffer, bucket.slots, iter(tensors.items()))
    assert {name: t.tolist() for name, t in unpack(buffer, bucket.slots)} == {n: t.tolist() for n, t in tensors.items()}


def embedding_and_first_layer_mb(model_dir: str) -> float:
    """A bucket size that puts the embedding and layer 0 in bucket 0, layer 1 in bucket 1 and the final norm and
    lm_head in bucket 2, no larger than bucket 0: the pipeline at work, and a layout where a receiver that reused
    bucket 0's buffer within the sync would write bucket 2 over it."""
    from transformers import AutoModelForCausalLM

    from grpo_dist.transports.delta import aligned
    from grpo_dist.transports.gloo_wire import ParamMeta, layer_groups, plan_buckets

    named = AutoModelForCausalLM.from_pretrained(model_dir).named_parameters(remove_duplicate=False)
    params = [ParamMeta(name, param.dtype, tuple(param.shape)) for name, param in named]
    by_name = {param.name: param for param in params}
    embedding, first_layer, *_ = layer_groups([param.name for param in params])
    size = sum(
        aligned(by_name[name].dtype.itemsize * math.prod(by_name[name].shape)) for name in embedding + first_layer
    )
    buckets = plan_buckets(params, size)
    assert len(buckets) == 3 and buckets[2].nbytes <= buckets[0].nbytes, [b.nbytes for b in buckets]
    assert buckets[0].slots[0].name == "model.embed_tokens.weight"
    return size / 2**20


@pytest.mark.slow
def test_a_rendezvous_port_is_free_and_outside_the_range_the_kernel_hands_out():
    """A port the kernel hands to any socket (gloo's pair connections, Ray's servers) could be taken between being
    chosen and the group's store listening on it: the learner group lost its rendezvous that way under load."""
    import socket
    from pathlib import Path

    from grpo_dist.cluster.actors.learner import RAY_WORKER_PORTS_END, free_port

    low, _ = (int(part) for part in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # drawn, not one fixed port every run shares
    for port in ports:
        assert RAY_WORKER_PORTS_END < port < low
        with socket.socket() as sock:
            sock.bind(("", port))


@pytest.mark.slow
def test_every_generator_holds_the_learners_weights_after_each_transport(ray_cluster, tmp_path):
    """2 ranks under ZeRO-3 train a step, then sync both generators; each generator's logprobs for a fixed sequence
    then equal the learner's (and differ from the initial model's), for each transport in turn."""
    from test_learner import sample_batch

    from grpo_dist.cluster.actors.generator import Generator
    from grpo_dist.cluster.learner_group import LearnerGroup
    from grpo_dist.models import build_tiny_model
    from grpo_dist.transports import make_transport, wire_backend

    model_dir = str(build_tiny_model(tmp_path / "model"))
    raw = small_config(tmp_path, learner={"num_ranks": 2, "zero_stage": 3, "micro_batch_size": 2, "lr": 1e-2})
    raw["rollout"]["num_generators"] = 2
    raw["sync"] = {"bucket_mb": embedding_and_first_layer_mb(model_dir)}
    cfg = validate_config(raw)
    assert wire_backend(cfg) == "gloo"
    learner = LearnerGroup.start(cfg, model_dir)
    generators = [
        ray_cluster.remote(Generator).options(num_cpus=1).remote(model_dir, cfg.rollout, index, "gloo")
        for index in range(2)
    ]
    sequence = [10, 11, 12, 7, 8, 9, 2]
    try:
        ray_cluster.get([generator.start.remote() for generator in generators])
        before = ray_cluster.get(generators[0].sequence_logprobs.remote(sequence))
        for version, name in enumerate(TRANSPORTS, start=1):
            sync = cfg.sync.model_copy(update={"transport": name})
            transport = make_transport(cfg.model_copy(update={"sync": sync}), learner, generators)
            assert transport.name == name
            transport.connect()
            learner.train(sample_batch())
            transport.sync(version)
            expected = torch.tensor(learner.sequence_logprobs(sequence))
            assert not torch.allclose(expected, torch.tensor(before), atol=1e-3), "the step should move the policy"
            for generator in generators:
                assert ray_cluster.get(generator.current_weight_version.remote()) == version
                got = torch.tensor(ray_cluster.get(generator.sequence_logprobs.remote(sequence)))
                torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4, msg=f"{name}: generator differs")
            before = expected.tolist()
    finally:
        learner.shutdown()
        for generator in generators:
            ray_cluster.kill(generator)


@pytest.mark.gpu(4)  # 2 learner ranks and an engine of 2 tensor-parallel workers, a GPU each
@pytest.mark.slow
def test_nccl_broadcast_reaches_both_workers_of_a_tensor_parallel_engine(ray_cluster, tmp_path):
    """On GPUs: 2 learner ranks under ZeRO-3 and one engine of tensor_parallel_size 2 (vLLM's Ray executor, a
    worker per GPU): the NCCL broadcast reaches both workers and the engine's logprobs equal the learner's."""
    from test_learner import sample_batch

    from grpo_dist.cluster.cluster import Cluster
    from grpo_dist.models import build_tiny_model

    model_dir = str(build_tiny_model(tmp_path / "model"))
    raw = small_config(
        tmp_path,
        learner={"num_ranks": 2, "zero_stage": 3, "micro_batch_size": 2, "lr": 1e-2, "num_gpus": 1},
        rollout={"num_generators": 1, "tensor_parallel_size": 2, "num_gpus": 1, "dtype": "float32"},
    )
    cfg = validate_config(raw)
    cluster = Cluster.start(cfg, model_dir)
    try:
        assert cluster.transport.name == "broadcast"
        cluster.learner.train(sample_batch())
        cluster.sync_weights()
        sequence = [10, 11, 12, 7, 8, 9, 2]
        expected = torch.tensor(cluster.learner.sequence_logprobs(sequence))
        got = torch.tensor(ray_cluster.get(cluster.generators.actors[0].sequence_logprobs.remote(sequence)))
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)  # the learner trains in bf16 on GPUs
    finally:
        cluster.shutdown()
