"""Delta weight sync with the real stack: 2 learner ranks under ZeRO-3 (DeepSpeed on gloo) and bf16 vLLM engines,
weights in buckets of one decoder layer; and the patch arithmetic both ends share."""

from __future__ import annotations

import pytest
import torch
from conftest import small_config

from grpo_dist.config import validate_config

SEQUENCE = [10, 11, 12, 7, 8, 9, 2]


def test_a_patch_carries_exactly_the_changed_elements_and_the_checksum_sees_any_flipped_bit():
    from grpo_dist.transports import delta

    old = torch.randn(1000).to(torch.bfloat16)
    new = old.clone()
    new[[3, 500, 999]] += 1.0
    new_bits, old_bits = (
        delta.bits(new.view(torch.uint8), torch.bfloat16),
        delta.bits(old.view(torch.uint8), torch.bfloat16),
    )
    indices = delta.positions(delta.differs(new_bits, old_bits))
    assert indices.tolist() == [3, 500, 999]
    payload = torch.zeros(4096, dtype=torch.uint8)
    written = delta.write_patch(payload, indices, new_bits[indices], numel=1000)
    # 3 int32 indices (12 bytes, aligned to 64) + 3 bf16 values (6 bytes, aligned to 64)
    assert written == delta.patch_nbytes(3, 1000, torch.bfloat16) == 128
    got_indices, got_values = delta.read_patch(payload, 3, 1000, torch.bfloat16)
    patched = old.clone()
    delta.bits(patched.view(torch.uint8), torch.bfloat16)[got_indices.long()] = got_values
    assert torch.equal(patched.view(torch.int16), new.view(torch.int16))
    # A patch of most elements costs more than the slot: it travels whole.
    assert delta.worth_a_patch(3, 1000, torch.bfloat16) and not delta.worth_a_patch(700, 1000, torch.bfloat16)

    buffer = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    before = delta.checksum([buffer])
    for position in torch.randint(0, 4096, (32,)).tolist():
        flipped = buffer.clone()
        flipped[position] ^= 1 << (position % 8)
        assert delta.checksum([flipped]) != before


def scale_every_weight(self) -> None:
    """On every learner rank (a ZeRO-3 gather): add 1/16 to every element, which changes each one in bf16."""
    import deepspeed

    params = list(self.engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
        if self.rank == 0:
            for param in params:
                param.add_(0.0625)


@pytest.mark.slow
def test_delta_sync_matches_a_full_sync_through_steps_joins_reconnects_and_updates_in_flight(ray_cluster, tmp_path):
    from test_learner import sample_batch

    from grpo_dist.cluster.actors.generator import Generator
    from grpo_dist.cluster.learner_group import LearnerGroup
    from grpo_dist.models import build_tiny_model
    from grpo_dist.transports import make_transport

    model_dir = str(build_tiny_model(tmp_path / "model"))
    raw = small_config(
        tmp_path,
        learner={"num_ranks": 2, "zero_stage": 3, "micro_batch_size": 2, "lr": 1e-3},
        rollout={"num_generators": 1, "dtype": "bfloat16", "max_new_tokens": 48, "max_model_len": 64},
    )
    raw["sync"] = {"delta": True, "full_every": 100, "bucket_mb": 0.01}  # a bucket per decoder layer
    cfg = validate_config(raw)
    learner = LearnerGroup.start(cfg, model_dir)
    generators = [ray_cluster.remote(Generator).options(num_cpus=1).remote(model_dir, cfg.rollout, 0, "gloo")]

    def engines() -> list[torch.Tensor]:
        calls = [generator.sequence_logprobs.remote(SEQUENCE) for generator in generators]
        return [torch.tensor(logprobs) for logprobs in ray_cluster.get(calls)]

    def equal_to_a_full_sync(transport, version: int) -> list[torch.Tensor]:
        """Each engine after the sync just made, then after a full sync of the same weights: bit for bit equal,
        and near the learner's (bf16 engines)."""
        after_delta = engines()
        assert transport.sync(version, full=True).mode == "full"
        after_full = engines()
        learner_logprobs = torch.tensor(learner.sequence_logprobs(SEQUENCE))
        for index, (got, want) in enumerate(zip(after_delta, after_full, strict=True)):
            assert torch.equal(got, want), f"generator {index}: delta {got} != full {want}"
            torch.testing.assert_close(got, learner_logprobs, atol=0.1, rtol=0.05)
        return after_full

    try:
        ray_cluster.get([generator.start.remote() for generator in generators])
        transport = make_transport(cfg, learner, generators)
        transport.connect()
        first = transport.sync(0)
        assert (first.mode, first.changed) == ("full", first.elements)  # nothing known of the engines yet
        initial = engines()

        nothing = transport.sync(0)  # nothing changed: a header of zero counts per slot and no payload
        assert (nothing.mode, nothing.changed) == ("delta", 0)
        from transformers import AutoModelForCausalLM

        named = list(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters(remove_duplicate=False))
        assert nothing.sent_bytes == 8 * len(named)  # tied weights are sent under each name

        learner.train(sample_batch())
        step = transport.sync(1)
        assert step.mode == "delta" and 0 < step.changed < step.elements, step
        trained = equal_to_a_full_sync(transport, 1)
        assert not torch.equal(trained[0], initial[0]), "the step should move the policy"

        learner.call("__ray_call__", scale_every_weight)
        everything = transport.sync(2)
        assert (everything.mode, everything.changed) == ("delta", everything.elements)
        scaled = equal_to_a_full_sync(transport, 2)
        assert not torch.allclose(scaled[0], trained[0], atol=1e-3), "scaling every weight should move the policy"

        # A worker whose copy is not at the version the delta is based on: the sync is done again in full.
        rank0 = learner.ranks[0]
        ray_cluster.get(
            rank0.__ray_call__.remote(lambda self: setattr(self.weight_sender.engine.state, "copy_version", 9))
        )
        learner.train(sample_batch())
        resynced = transport.sync(3)
        assert resynced.mode == "full"
        equal_to_a_full_sync(transport, 3)

        # An elastic join: a second generator, the transport connected afresh (as after a resume): a full sync
        # first, then deltas reach both.
        generators.append(ray_cluster.remote(Generator).options(num_cpus=1).remote(model_dir, cfg.rollout, 1, "gloo"))
        ray_cluster.get(generators[-1].start.remote())
        transport = make_transport(cfg, learner, generators)
        transport.connect()
        assert transport.sync(3).mode == "full"
        learner.train(sample_batch())
        assert transport.sync(4).mode == "delta"
        equal_to_a_full_sync(transport, 4)

        # In flight: a delta lands while both engines sample long completions; they go on with the new weights.
        learner.train(sample_batch())
        calls = [generator.generate.remote([1 + index, 2], 4, None, index, index) for index, generator in
                 enumerate(generators)]  # fmt: skip
        assert transport.sync(5).mode == "delta"
        completions = [completion for group in ray_cluster.get(calls, timeout=300) for completion in group]
        assert {completion.weight_version for completion in completions} <= {4, 5}
        equal_to_a_full_sync(transport, 5)
    finally:
        learner.shutdown()
        for generator in generators:
            ray_cluster.kill(generator)
