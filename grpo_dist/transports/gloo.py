"""vLLM weight-transfer engines over gloo: the broadcast transport's wire on machines without GPUs, and delta sync's
wire everywhere.

vLLM ships trainer/worker engine pairs (`vllm.distributed.weight_transfer`) and an NCCL pair for GPUs; this module
registers a "gloo" pair under the same factories, so CPU runs (and CI) take the protocol a GPU cluster takes:
the trainer's rank 0 and every vLLM worker join one process group (the trainer is rank 0, worker w of generator g
is rank 1 + g * tensor_parallel_size + w), the trainer declares the parameters (names, wire dtypes, shapes), and
both sides cut them into the same buckets: whole decoder layers, about `bucket_bytes` each (a larger layer is a
bucket of its own). Each bucket travels as one flat byte tensor.

A sync is pipelined bucket by bucket: while bucket k is on the wire the sender gathers and packs bucket k+1 (two
buffers, reused from sync to sync) and each worker loads bucket k-1 into its engine. A worker receives each bucket
into a buffer of its own, kept from sync to sync: vLLM's layerwise reload processes a layer once all its weights
are in, and holds the tensors of one it cannot count as complete until the update finishes, so a received bucket
is never written over within a sync.
The bucket plan and the buffers are made once per connection; the control plane is one call per generator and sync
(`apply_weight_update`: pause, start, receive, finish, resume).

Delta sync (`delta`): the sender keeps the engines' copy of the weights (in the wire dtype, laid out in buckets)
and each worker has its own, the buffers a full sync arrived in. A delta sync sends, per bucket, a header of
changed-element counts and a payload of patches (`grpo_dist.transports.delta`); a worker patches its copy and
reloads the layers that changed. Every sync in delta mode ends with each worker's checksum of its copy and of the
version it is based on: any that differs from the sender's has the sync done again in full. Every `full_every`-th
sync is full anyway.

Importing the module registers the worker engine with vLLM: the generator's worker extension
(`grpo_dist.transports.weight_sync`) imports it inside every vLLM worker. The learner's side is vLLM's trainer-engine
protocol written without vLLM's types (`gloo_sender`), so the learner never imports vLLM.

The module's parts: `gloo_wire` (what a sync declares, the bucket plan, packing, the group and broadcast),
`gloo_engine` (the worker side), `gloo_sender` (the trainer side).
"""

from __future__ import annotations

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from grpo_dist.transports.gloo_engine import GlooWeightTransferEngine, reload_warnings_quiet
from grpo_dist.transports.gloo_wire import BACKEND, GlooTrainerInitInfo

__all__ = ["GlooTrainerInitInfo", "reload_warnings_quiet"]

WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
